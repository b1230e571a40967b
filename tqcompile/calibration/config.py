"""PTQ/QAT configs: ordered rules that set or disable each module's quantizers.

A `QuantConfig` is a tuple of `QuantRule`s. Every quantizable module starts with all three of its
quantizers (input, weight, output) disabled; the rules are then applied in order and a later rule
overrides what an earlier one set. A rule matches a module

- by name: an `fnmatch` glob on the module's *canonical* name, the fully qualified name with the
  wrapper components removed (DDP's and DataParallel's ``module.``, `torch.compile`'s
  ``_orig_mod.``), so a config means the same model wrapped or not;
- by class: `isinstance` (subclasses included). The batch norms form one family: a rule naming
  `BatchNorm1d/2d/3d` or `SyncBatchNorm` matches all of them, because
  `nn.SyncBatchNorm.convert_sync_batchnorm` turns one into the other;
- by both (both must hold); a rule with neither matches every module.

Each grouped GEMM of a MoE experts module is its own unit (`ExpertGemmQuantizers`, named
``<experts>.<weight>_gemm``); a rule matching the experts module itself (``"*.mlp.experts"``,
``module_types=(MixtralExperts,)``) applies to all of its GEMMs.

Each quantizer slot of a rule is `None` (leave as earlier rules set it), `False` (disable) or a
`tq.Quantizer` (enable with it). Configs are frozen values: comparable, hashable, and serialisable
with `to_dict()` / `QuantConfig.from_dict()` (plain Python types, so a saved quant state loads
with ``torch.load(..., weights_only=True)``).

A serialised rule names its module classes as ``"package.module.ClassName"``. A saved config is
data, maybe from someone else: `from_dict` resolves such a name only among the classes it is given
(`tq.restore` gives the classes of the model's modules and their bases) and those registered with
`register_module_type` (tq registers the classes its presets name), and never imports anything.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
from collections.abc import Iterable
from typing import Any

from torch import nn

from tqcompile.formats import Format
from tqcompile.quantizers import Granularity, Quantizer
from tqcompile.quantizers.base import quantizer_families

__all__ = [
    "QuantRule", "QuantConfig", "ConfigError", "STE_MODES", "SLOTS", "KV_SLOTS", "ATTENTION_SLOTS", "register_module_type", "module_type_name",
]

SLOTS = ("input", "weight", "output")
# An attention module's KV-cache quantizers (`tqcompile.calibration.attention`).
KV_SLOTS = ("key", "value")
# An attention module's quantizers: the query's (optional, one scale per layer: vLLM's q_scale) and the KV cache's.
ATTENTION_SLOTS = ("query", *KV_SLOTS)
STE_MODES = ("clipped", "plain")

# Classes that stand for one another in a rule: convert_sync_batchnorm turns any of them into a
# SyncBatchNorm (and a single-process rebuild turns it back), so a rule must not depend on which.
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class ConfigError(ValueError):
    """A config that cannot be used: the message names the field, the value and what is allowed."""


# Classes a serialised rule may name whatever model it is restored into: by name, see `register_module_type`.
_REGISTERED_MODULE_TYPES: dict[str, type] = {}


def module_type_name(cls: type) -> str:
    """How a rule's module class is written in a saved config: ``"package.module.ClassName"``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_module_type(*classes: type) -> None:
    """Let saved configs name `classes` in their rules' `module_types`, also when restoring into a
    model that does not contain them (`tq.restore` resolves names among the model's own classes
    and these, and imports nothing).

    Example:
        >>> tq.calibration.register_module_type(MyAttention)
    """
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ConfigError(f"register_module_type: {cls!r} is not allowed; allowed: nn.Module subclasses, e.g. nn.Linear")
        _REGISTERED_MODULE_TYPES[module_type_name(cls)] = cls


# The torch classes the presets (tq.configs) and the quantizable kinds name; tq's own register where defined.
register_module_type(
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, *_BATCH_NORMS, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.Embedding
)


def _family(cls: type) -> tuple[type, ...]:
    return (nn.modules.batchnorm._BatchNorm,) if cls in _BATCH_NORMS else (cls,)


def kv_quantizer_problem(q: Quantizer) -> str | None:
    """Why `q` cannot quantize a KV cache, or None: FP8 E4M3 with a static amax per layer
    (TENSORWISE) or per KV head (ROWWISE along the last dim), the caches engines load. vLLM 0.32's
    compressed-tensors loader takes num_bits 8, type float only; its ModelOpt loader FP8 only."""
    gran, axis, _ = q.layout()
    # FP8 E4M3 under one fp32 scale per tensor or per row: asked of the quantizer, not of its class.
    if not (q.scaled_mm_operand() and q.element_format() is Format.E4M3):
        return (
            "allowed: Float8Quantizer(E4M3), TENSORWISE (one scale per layer) or ROWWISE (one per KV head), "
            "as tq.configs.fp8_kv_cache() makes; no engine loads an INT8 or E5M2 KV cache from a checkpoint"
        )
    if gran is Granularity.ROWWISE and axis != -1:
        return "a per-head (ROWWISE) KV quantizer takes axis=-1: each KV head is one row of the cache"
    return None


def query_quantizer_problem(q: Quantizer) -> str | None:
    """Why `q` cannot quantize an attention's query, or None: FP8 E4M3 with one static scale per
    layer (TENSORWISE). vLLM 0.32 reads one ``q_scale`` per attention, a single float."""
    if kv_quantizer_problem(q) is not None or q.layout()[0] is not Granularity.TENSORWISE:
        return (
            "allowed: Float8Quantizer(E4M3), TENSORWISE (one scale per layer), as tq.configs.fp8_kv_cache(query=True) makes: "
            "vLLM reads one FP8 q_scale per attention"
        )
    return None


def _check_slot(field: str, value: object) -> None:
    if value is None or value is False or isinstance(value, Quantizer):
        return
    if isinstance(value, type) and issubclass(value, Quantizer):
        raise ConfigError(f"QuantRule: {field}={value.__name__} is a class; pass an instance, e.g. {value.__name__}()")
    raise ConfigError(
        f"QuantRule: {field}={value!r} is not allowed; allowed: a tq.Quantizer (enable), False (disable) or None (unchanged)"
    )


@dataclasses.dataclass(frozen=True)
class QuantRule:
    """One rule: which modules (`name` glob and/or `module_types`) and what to set on them.

    Args:
        name: an `fnmatch` glob on the canonical module name (wrapper prefixes removed), e.g.
            ``"*lm_head"`` or ``"layers.*.mlp.*"``; None matches any name.
        module_types: classes the module must be an instance of (one suffices); () matches any.
        input / weight / output: a `tq.Quantizer` to enable that quantizer, False to disable it,
            None to leave it as earlier rules set it.
        must_match: warn (naming the rule) when it matches no module of the model.
        key / value: the KV-cache quantizers of attention modules (keys after the rotary
            embedding and values, as they enter the cache; `tqcompile.calibration.attention`),
            set as the other slots are. Attention modules have only these and `query`, other
            modules only input, weight and output: a rule's slots apply where the module has them.
        query: an attention's query quantizer (the query after the rotary embedding, as the
            attention computes with it), FP8 E4M3 per layer; only with key and value quantizers
            (engines use a query scale with an FP8 KV cache only).

    Example:
        >>> QuantRule(name="*lm_head", input=False, weight=False, output=False)
        >>> QuantRule(key=tq.Float8Quantizer(), value=tq.Float8Quantizer())   # FP8 KV cache, per layer
    """

    name: str | None = None
    module_types: tuple[type, ...] = ()
    input: Quantizer | bool | None = None
    weight: Quantizer | bool | None = None
    output: Quantizer | bool | None = None
    must_match: bool = True
    key: Quantizer | bool | None = None
    value: Quantizer | bool | None = None
    query: Quantizer | bool | None = None

    def __post_init__(self) -> None:
        if self.name is not None and not isinstance(self.name, str):
            raise ConfigError(f"QuantRule: name={self.name!r} is not allowed; allowed: a glob string or None")
        types = self.module_types
        if not isinstance(types, tuple) or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
            raise ConfigError(
                f"QuantRule: module_types={types!r} is not allowed; allowed: a tuple of nn.Module subclasses, e.g. (nn.Linear,)"
            )
        for f in (*SLOTS, *ATTENTION_SLOTS):
            _check_slot(f, getattr(self, f))
            q = getattr(self, f)
            if f != "weight" and isinstance(q, Quantizer) and q.has_zero_point():
                raise ConfigError(
                    f"QuantRule: {f}={q!r} is not allowed; zero points (IntGrid.ASYMMETRIC) are for weights: quantize "
                    "activations and caches on IntGrid.FULL or SYMMETRIC"
                )
        for f in ATTENTION_SLOTS:
            q = getattr(self, f)
            problem = None if not isinstance(q, Quantizer) else query_quantizer_problem(q) if f == "query" else kv_quantizer_problem(q)
            if problem:
                what = "a query" if f == "query" else "a KV-cache"
                raise ConfigError(f"QuantRule: {f}={q!r} is not allowed as {what} quantizer; {problem}")
        if not isinstance(self.must_match, bool):
            raise ConfigError(f"QuantRule: must_match={self.must_match!r} is not allowed; allowed: True or False")

    @classmethod
    def disable(cls, name: str | None = None, module_types: tuple[type, ...] = (), *, must_match: bool = True) -> QuantRule:
        """A rule that disables every quantizer of the modules it matches (an attention's query and KV cache included)."""
        return cls(name, module_types, False, False, False, must_match, key=False, value=False, query=False)

    def matches(self, canonical_name: str, module: nn.Module) -> bool:
        """True when this rule applies to `module`, named `canonical_name` (wrapper prefixes removed).

        A GEMM of a MoE experts module (`ExpertGemmQuantizers`, named ``<experts>.<weight>_gemm``)
        is also matched by a rule that matches its experts module (by name or class): that module
        holds its weight, and a rule naming it must not match without effect."""
        if self._matches_one(canonical_name, module):
            return True
        owner = getattr(module, "tq_rule_owner", None)
        return owner is not None and self._matches_one(canonical_name.rpartition(".")[0], owner)

    def _matches_one(self, canonical_name: str, module: nn.Module) -> bool:
        if self.name is not None and not fnmatch.fnmatchcase(canonical_name, self.name):
            return False
        if self.module_types and not any(isinstance(module, _family(t)) for t in self.module_types):
            return False
        return True

    def describe(self) -> str:
        what = [f"name={self.name!r}"] if self.name is not None else []
        what += [f"module_types=({', '.join(t.__name__ for t in self.module_types)})"] if self.module_types else []
        return f"QuantRule({', '.join(what) or 'every module'})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module_types": [module_type_name(t) for t in self.module_types],
            **{f: _slot_to_dict(getattr(self, f)) for f in SLOTS},
            "must_match": self.must_match,
            **{f: _slot_to_dict(getattr(self, f)) for f in KV_SLOTS},
            "query": _slot_to_dict(self.query),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], module_types: Iterable[type] = ()) -> QuantRule:
        """The rule `to_dict` wrote; class names resolve among `module_types` and the registered
        classes (`register_module_type`), never by import."""
        if not isinstance(d, dict):
            raise ConfigError(f"QuantRule.from_dict: expected a dict, got {type(d).__name__}")
        unknown = set(d) - {"name", "module_types", *SLOTS, "must_match", *ATTENTION_SLOTS}
        if unknown:
            raise ConfigError(
                f"QuantRule.from_dict: unknown fields {sorted(unknown)}; allowed: name, module_types, input, weight, output, "
                "must_match, key, value, query"
            )
        known = _known_classes(module_types)
        names = d.get("module_types", ())
        if not isinstance(names, list | tuple):
            raise ConfigError(f"QuantRule.from_dict: module_types={names!r} is not allowed; allowed: a list of class names")
        return cls(
            d.get("name"),
            tuple(_resolve_class(n, known) for n in names),
            **{f: _slot_from_dict(f, d.get(f)) for f in SLOTS},
            must_match=d.get("must_match", True),
            **{f: _slot_from_dict(f, d.get(f)) for f in ATTENTION_SLOTS},  # a rule saved before the query slot has none
        )


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """An ordered tuple of `QuantRule`s (later ones override earlier ones) and the QAT gradient rule.

    Args:
        rules: the rules, applied in order.
        ste: the straight-through estimator fake quantization uses in backward: "clipped" (zero
            gradient where the input lies beyond the quantizer's range, i.e. saturated) or
            "plain" (the gradient passes unchanged).

    Example:
        >>> cfg = tq.configs.int8().with_rules(QuantRule.disable("features.0"))
    """

    rules: tuple[QuantRule, ...] = ()
    ste: str = "clipped"

    def __post_init__(self) -> None:
        if not isinstance(self.rules, tuple):
            raise ConfigError(
                f"QuantConfig: rules of type {type(self.rules).__name__} is not allowed; allowed: a tuple of QuantRule"
            )
        for i, r in enumerate(self.rules):
            if not isinstance(r, QuantRule):
                raise ConfigError(f"QuantConfig: rules[{i}]={r!r} is not allowed; allowed: a QuantRule")
        if self.ste not in STE_MODES:
            raise ConfigError(f"QuantConfig: ste={self.ste!r} is not allowed; allowed: {', '.join(map(repr, STE_MODES))}")

    def with_rules(self, *rules: QuantRule) -> QuantConfig:
        """A new config with `rules` appended (so they override this config's rules)."""
        for r in rules:
            if not isinstance(r, QuantRule):
                raise ConfigError(
                    f"QuantConfig.with_rules: {r!r} is not a QuantRule; pass rules as separate arguments, e.g. "
                    "with_rules(QuantRule(...), QuantRule(...)) (or with_rules(*rules) for a list)"
                )
        return dataclasses.replace(self, rules=self.rules + tuple(rules))

    def resolve(self, canonical_name: str, module: nn.Module) -> dict[str, Quantizer | None]:
        """The quantizer of each slot (input, weight, output, query, key, value) for one module (None: disabled)."""
        out: dict[str, Quantizer | None] = dict.fromkeys((*SLOTS, *ATTENTION_SLOTS))
        for rule in self.rules:
            if rule.matches(canonical_name, module):
                for f in out:
                    v = getattr(rule, f)
                    if v is not None:
                        out[f] = v or None
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain Python types only (strings, numbers, lists, dicts, None)."""
        return {"rules": [r.to_dict() for r in self.rules], "ste": self.ste}

    @classmethod
    def from_dict(cls, d: dict[str, Any], module_types: Iterable[type] = ()) -> QuantConfig:
        """The config `to_dict` wrote. A rule's class names resolve among `module_types` and the
        classes registered with `register_module_type`; nothing is imported (a config is data), so
        a name found in neither raises, naming it.

        Example:
            >>> QuantConfig.from_dict(d, module_types=[type(m) for m in model.modules()])
        """
        if not isinstance(d, dict):
            raise ConfigError(f"QuantConfig.from_dict: expected a dict, got {type(d).__name__}")
        unknown = set(d) - {"rules", "ste"}
        if unknown:
            raise ConfigError(f"QuantConfig.from_dict: unknown fields {sorted(unknown)}; allowed: rules, ste")
        module_types = tuple(module_types)
        return cls(tuple(QuantRule.from_dict(r, module_types) for r in d.get("rules", ())), d.get("ste", "clipped"))


def quantizer_to_dict(q: Quantizer) -> dict[str, Any]:
    d: dict[str, Any] = {"type": type(q).__name__}
    for f in dataclasses.fields(q):
        v = getattr(q, f.name)
        d[f.name] = v.name if isinstance(v, enum.Enum) else v
    return d


def quantizer_from_dict(d: dict[str, Any], where: str = "quantizer") -> Quantizer:
    if not isinstance(d, dict) or "type" not in d:
        raise ConfigError(f"{where}: expected a dict with a 'type' key, got {d!r}")
    classes = {c.__name__: c for c in quantizer_families()}
    cls = classes.get(d["type"])
    if cls is None:
        raise ConfigError(f"{where}: type={d['type']!r} is not allowed; allowed: {', '.join(classes)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    # An enum field is written by member name; its default says which enum (Format, Granularity, ...).
    enums = {f.name: type(f.default) for f in dataclasses.fields(cls) if isinstance(f.default, enum.Enum)}
    unknown = set(d) - fields - {"type"}
    if unknown:
        raise ConfigError(f"{where}: unknown {cls.__name__} fields {sorted(unknown)}; allowed: {', '.join(sorted(fields))}")
    kwargs = {}
    for k, v in d.items():
        if k == "type":
            continue
        if k in enums:
            enum_cls = enums[k]
            if v not in enum_cls.__members__:
                raise ConfigError(f"{where}: {k}={v!r} is not allowed; allowed: {', '.join(enum_cls.__members__)}")
            v = enum_cls[v]
        kwargs[k] = v
    return cls(**kwargs)


def _slot_to_dict(v: Quantizer | bool | None) -> dict[str, Any] | bool | None:
    return quantizer_to_dict(v) if isinstance(v, Quantizer) else v


def _slot_from_dict(field: str, v: Any) -> Quantizer | bool | None:
    if v is None or v is False:
        return v
    return quantizer_from_dict(v, where=f"QuantRule.{field}")


def _known_classes(module_types: Iterable[type]) -> dict[str, list[type]]:
    """{name: the distinct classes of that name} among `module_types` and the registered classes."""
    known: dict[str, list[type]] = {}
    for c in (*module_types, *_REGISTERED_MODULE_TYPES.values()):
        same = known.setdefault(module_type_name(c), [])
        if c not in same:
            same.append(c)
    return known


def _resolve_class(name: Any, known: dict[str, list[type]]) -> type:
    if not isinstance(name, str) or "." not in name:
        raise ConfigError(f"QuantRule.from_dict: module_types entry {name!r} is not allowed; allowed: 'package.module.ClassName'")
    found = known.get(name, [])
    if len(found) == 1:
        return found[0]
    if found:  # e.g. a class defined in a function that ran twice: which one the rule meant is unknown
        raise ConfigError(
            f"QuantRule.from_dict: module_types entry {name!r} names {len(found)} different classes of the model; allowed: "
            "a name of one class (define the class once, at module level, or match those modules by name)"
        )
    short = name.rpartition(".")[2]
    raise ConfigError(
        f"QuantRule.from_dict: module_types entry {name!r} is not a class of the model (the module_types given) nor one registered with tq; "
        "a saved config is data and tq never imports what it names. Allowed: the classes of the model's modules "
        f"(and their bases) and registered ones; if {name!r} is yours, register it before restoring: "
        f"tq.calibration.register_module_type({short})"
    )
