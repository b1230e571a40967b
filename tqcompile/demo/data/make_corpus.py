"""Writes `corpus.txt`, the demo's training text: original English prose generated from a small
grammar of tales about a harbour town (no downloaded text, no licence to track).

Deterministic: `python tqcompile/demo/data/make_corpus.py` rewrites the same file byte for byte.
"""

from __future__ import annotations

import pathlib
import random

PEOPLE = [
    "the old sailor", "the miller's daughter", "a young clerk", "the keeper of the lighthouse", "the baker",
    "a travelling tinker", "the widow Marsh", "the schoolmaster", "a boy named Tom", "the harbour master",
    "Captain Reed", "the blacksmith", "a girl called Ada", "the parson", "the ferryman", "two fishermen",
]
PLACES = [
    "the harbour", "the market square", "the mill by the river", "the lighthouse", "the chapel on the hill",
    "the old inn", "the long pier", "the salt marsh", "the narrow lane", "the schoolhouse", "the boatyard",
    "the orchard", "the cliff path", "the customs house",
]
TIMES = [
    "At dawn", "In the evening", "On a grey morning", "Late that night", "Before the tide turned",
    "When the bells rang noon", "In the first week of spring", "On the coldest day of winter",
    "After the storm", "Long ago", "One summer afternoon", "By candlelight",
]
VERBS = [
    "walked to", "hurried to", "looked out over", "came back from", "waited at", "sang softly near",
    "went down to", "climbed up to", "sat quietly in", "wandered through", "returned to", "left",
]
THINGS = [
    "a lantern", "a letter sealed with red wax", "a basket of apples", "an old map", "a silver key",
    "a net full of herring", "a loaf of warm bread", "a broken compass", "a bundle of firewood",
    "a small wooden boat", "a book of songs", "a jar of honey", "a coil of rope", "a blue coat",
]
ADJECTIVES = ["quiet", "cold", "bright", "windy", "empty", "crowded", "golden", "misty", "still", "dark"]
FEELINGS = ["glad", "tired", "afraid", "curious", "sorry", "proud", "anxious", "content", "puzzled"]
WEATHER = [
    "The wind came in from the sea", "Rain fell on the slate roofs", "The fog lay thick upon the water",
    "The sun was low and red", "Snow drifted against the doors", "The gulls cried over the boats",
    "The tide was running out", "A warm breeze moved the sails",
]
SAYINGS = [
    "The sea gives and the sea takes", "We shall see what the morning brings", "Nothing is lost that is remembered",
    "Every road leads home in the end", "A kind word costs nothing", "The lamp must be lit before dark",
    "Mind the tide and the tide will mind you", "There is always bread for a friend",
]
SINCE = ["the day of the fair", "the last full moon", "the great storm", "the autumn before", "the ship sailed", "midsummer"]


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def sentence(rng: random.Random) -> str:
    kind = rng.randrange(8)
    who, place, thing = rng.choice(PEOPLE), rng.choice(PLACES), rng.choice(THINGS)
    if kind == 0:
        return f"{rng.choice(TIMES)}, {who} {rng.choice(VERBS)} {place}."
    if kind == 1:
        return f"{_cap(who)} carried {thing} to {place}, and the streets were {rng.choice(ADJECTIVES)}."
    if kind == 2:
        return f"{rng.choice(WEATHER)}, and {who} was {rng.choice(FEELINGS)}."
    if kind == 3:
        return f'"{rng.choice(SAYINGS)}," said {who}.'
    if kind == 4:
        other = rng.choice(PEOPLE)
        return f"{_cap(who)} gave {thing} to {other}, who thanked them and {rng.choice(VERBS)} {place}."
    if kind == 5:
        return f"The {rng.choice(ADJECTIVES)} light fell across {place} while {who} counted the hours."
    if kind == 6:
        return f'"Have you seen {thing}?" asked {who}. "I left it at {place}."'
    return f"Nobody in {place} had seen {thing} since {rng.choice(SINCE)}."


def paragraph(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(3, 7)))


def corpus(n_chars: int = 120_000, seed: int = 1) -> str:
    """Paragraphs of generated prose, about `n_chars` characters, ASCII only."""
    rng = random.Random(seed)
    parts, size, chapter = [], 0, 1
    while size < n_chars:
        if rng.random() < 0.08 or not parts:
            parts.append(f"CHAPTER {chapter}")
            chapter += 1
        parts.append(paragraph(rng))
        size += len(parts[-1]) + 2
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    pathlib.Path(__file__).with_name("corpus.txt").write_text(corpus(), encoding="ascii")
