#!/usr/bin/env python
"""Perplexity gate: a held-out text's perplexity per `--quantization`, beside transformers' float32.

The text (default `tests/data/heldout.txt`, original prose written for this project) is tokenized once with
the model's tokenizer (no special tokens) and cut into non-overlapping windows of `--window` tokens (stride =
window; the last window holds what is left, if at least 2 tokens). Each window is scored on its own: the first
token of a window is context only, every later token is scored by its log-probability given the tokens before
it in the window. Perplexity = exp(total NLL / tokens scored). The very same windows are scored by:

- jaxllm, once per quantization, one engine at a time (`SamplingParams(prompt_logprobs=0, max_tokens=0)`, all
  windows in one `generate`, `max_model_len` one block above the window): `none` (every weight dequantized to
  float32: the reference), `native` (`quantization=None`: the GGUF's own blocks, Q4_1 / Q8_0 for the default
  model; the same weights as `none`, only the order of summation differs), `int8` (weight-only, per output
  channel), `int4` (groups of 32);
- transformers (PyTorch, float32) loading the same GGUF file (`gguf_file=`: dequantized on load).

`--int8-dot off on` scores each quantized setting once per `JAXLLM_CPU_INT8_DOT` mode: "off" the CPU kernel's
float-activation path, "on" its integer path (x quantized to int8 blocks of 32, as llama.cpp's CPU backend does;
rows `native+int8dot` ...), so what 8-bit activations cost shows beside what the weights' formats cost.

Reported per setting: perplexity, mean NLL, tokens scored, the ratio of its perplexity to jaxllm float32
(`none`) and to transformers, the largest per-token logprob difference from `none`, and seconds (engine
start-up and scoring apart).

    python benchmarks/perplexity.py --output benchmarks/results/perplexity_cpu.json
    python benchmarks/perplexity.py --quantization none int8 --window 128 --max-text-tokens 1024  # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "heldout.txt"
SETTINGS = ["none", "native", "int8", "int4"]  # "native": quantization=None, the GGUF's own blocks
KV_BLOCK_SIZE = 16


# ---- the text and its windows -----------------------------------------------------------------------------


def make_windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows of `window` tokens (stride = window); the last one holds the rest (if >= 2)."""
    if window < 2:
        raise ValueError("a window needs at least 2 tokens (its first one is not scored)")
    windows = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    return [w for w in windows if len(w) >= 2]


def text_token_ids(tokenizer, path: Path, max_tokens: int | None = None) -> list[int]:
    ids = list(tokenizer.encode(path.read_text(), add_special_tokens=False))
    return ids[:max_tokens] if max_tokens else ids


def summary(logprobs: list[np.ndarray]) -> dict:
    """Perplexity of per-window arrays of scored tokens' logprobs (each window's tokens 1..n-1)."""
    nll = -np.concatenate(logprobs).astype(np.float64)
    mean = float(nll.mean())
    return {"perplexity": math.exp(mean), "mean_nll": mean, "tokens_scored": int(nll.size)}


# ---- jaxllm -----------------------------------------------------------------------------------------------


def has_quantization() -> bool:
    """Whether `LLM(quantization=...)` exists (issue 29's EngineArgs.quantization)."""
    from jaxllm.engine.args import EngineArgs

    return any(f.name == "quantization" for f in dataclasses.fields(EngineArgs))


def quantization_kwargs(setting: str) -> dict:
    """`LLM(...)` keyword arguments of a setting. Without EngineArgs.quantization only `none` exists (today's
    path: every GGUF tensor dequantized), asked for by omitting the argument."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown quantization setting {setting!r} (one of {', '.join(SETTINGS)})")
    if not has_quantization():
        if setting != "none":
            raise RuntimeError(
                f"quantization {setting!r} needs LLM(quantization=...), which jaxllm does not have yet (issue 29)"
            )
        return {}
    return {"quantization": None if setting == "native" else setting}


INT8_DOT = "+int8dot"  # a setting's suffix: the CPU kernel's integer path (JAXLLM_CPU_INT8_DOT=on)


def make_engine(setting: str, window: int, *, model: str | None = None, **engine_args):
    """An engine for `setting` (a quantization, `+int8dot` for the integer path), sized for scoring windows of
    `window` tokens; and its start-up seconds."""
    from jaxllm import LLM

    int8_dot = setting.endswith(INT8_DOT)
    setting = setting.removesuffix(INT8_DOT)

    args = {
        "max_model_len": window + KV_BLOCK_SIZE,
        "block_size": KV_BLOCK_SIZE,
        "dtype": "float32",
        "progress": False,
        **engine_args,
        **quantization_kwargs(setting),
    }
    started = time.perf_counter()
    before = os.environ.get("JAXLLM_CPU_INT8_DOT")
    os.environ["JAXLLM_CPU_INT8_DOT"] = "on" if int8_dot else "off"
    try:
        llm = LLM(model, **args)
    finally:
        os.environ.pop("JAXLLM_CPU_INT8_DOT")
        if before is not None:
            os.environ["JAXLLM_CPU_INT8_DOT"] = before
    return llm, time.perf_counter() - started


def score_jaxllm(llm, windows: list[list[int]]) -> list[np.ndarray]:
    """Each window's scored tokens' logprobs (tokens 1..n-1 of the window), all windows in one generate."""
    from jaxllm import SamplingParams

    params = SamplingParams(prompt_logprobs=0, max_tokens=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    scored = []
    for out, w in zip(outputs, windows, strict=True):
        entries = out.prompt_logprobs
        assert list(out.prompt_token_ids) == w and entries is not None and entries[0] is None
        scored.append(np.array([entries[i][w[i]].logprob for i in range(1, len(w))], dtype=np.float64))
    return scored


# ---- transformers -----------------------------------------------------------------------------------------


def load_transformers(model: str | None = None):
    """transformers' float32 PyTorch model on the same GGUF file (the default model's unless `model`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.weights.default import default_model_path

    path = Path(model) if model else default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return hf.eval()


def score_transformers(hf_model, windows: list[list[int]]) -> list[np.ndarray]:
    import torch

    scored = []
    with torch.no_grad():
        for w in windows:
            logits = hf_model(torch.tensor([w])).logits[0, :-1].double()
            logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(w[1:])[:, None])[:, 0]
            scored.append(logprobs.numpy())
    return scored


# ---- main -------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=SETTINGS,
        choices=SETTINGS,
        help="settings to score (default: all); 'native' is quantization=None (the GGUF's own blocks)",
    )
    parser.add_argument("--window", type=int, default=512, help="tokens per window, non-overlapping (default 512)")
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="the held-out text (default tests/data/heldout.txt)")
    parser.add_argument("--max-text-tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded default model)")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' float32 reference")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="rows of logits a step: positions scored")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--kv-cache-memory-bytes", type=int, default=256 << 20, help="KV cache budget (default 256 MiB)"
    )
    parser.add_argument(
        "--int8-dot",
        nargs="+",
        default=["off"],
        choices=["off", "on"],
        help="the CPU kernel's paths for quantized weights: off (float activations), on (x in int8 blocks)",
    )
    parser.add_argument("--output", default=None, help="write the result JSON here")
    args = parser.parse_args()
    if args.window < 2:
        parser.error("--window must be >= 2")
    settings = list(dict.fromkeys(args.quantization))
    if not has_quantization() and settings != ["none"]:
        parser.error("this jaxllm has no quantization argument yet (issue 29): only --quantization none runs")
    # the float32 reference first: the others' ratios are to it
    settings.sort(key=lambda s: s != "none")
    settings = [s + suffix for s in settings for suffix in ("" if m == "off" else INT8_DOT for m in args.int8_dot)]
    settings = [s for s in settings if s != "none" + INT8_DOT]  # float32 weights: no quantized kernel

    from jaxllm.bench import offline

    load_start = [round(x, 2) for x in os.getloadavg()]
    engine_args = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
    }
    windows: list[list[int]] = []
    num_text_tokens = 0
    rows, reference, cpu_kernels = [], None, None
    for setting in settings:
        llm, startup = make_engine(setting, args.window, model=args.model, **engine_args)
        if not windows:
            token_ids = text_token_ids(llm.get_tokenizer(), Path(args.text), args.max_text_tokens)
            num_text_tokens = len(token_ids)
            windows = make_windows(token_ids, args.window)
            cpu_kernels = offline.cpu_kernel_info(llm)
        started = time.perf_counter()
        scored = score_jaxllm(llm, windows)
        seconds = time.perf_counter() - started
        del llm
        gc.collect()
        row = {"quantization": setting, **summary(scored)}
        if setting == "none":
            reference = scored
        if reference is not None:
            diff = max(float(np.abs(a - b).max()) for a, b in zip(scored, reference, strict=True))
            row["max_abs_logprob_diff_vs_float32"] = diff
        row["startup_seconds"] = round(startup, 2)
        row["seconds"] = round(seconds, 3)
        row["tokens_per_second"] = round(row["tokens_scored"] / seconds, 1)
        rows.append(row)
        print(
            f"{setting:>6}: perplexity {row['perplexity']:.4f} (mean NLL {row['mean_nll']:.5f}, "
            f"{row['tokens_scored']} tokens, {seconds:.1f}s; start-up {startup:.1f}s)",
            flush=True,
        )

    hf_row = None
    if not args.no_transformers:
        import torch
        import transformers

        started = time.perf_counter()
        hf_model = load_transformers(args.model)
        load_seconds = time.perf_counter() - started
        started = time.perf_counter()
        hf_scored = score_transformers(hf_model, windows)
        seconds = time.perf_counter() - started
        hf_row = {
            "name": f"transformers {transformers.__version__} (torch {torch.__version__}), float32",
            **summary(hf_scored),
            "load_seconds": round(load_seconds, 2),
            "seconds": round(seconds, 3),
        }
        if reference is not None:
            diff = max(float(np.abs(a - b).max()) for a, b in zip(hf_scored, reference, strict=True))
            hf_row["max_abs_logprob_diff_vs_float32"] = diff
        del hf_model
        print(f"transformers float32: perplexity {hf_row['perplexity']:.4f} ({seconds:.1f}s; load {load_seconds:.1f}s)")

    ppl_none = next((r["perplexity"] for r in rows if r["quantization"] == "none"), None)
    for row in rows:
        row["ratio_to_float32"] = round(row["perplexity"] / ppl_none, 6) if ppl_none else None
        row["ratio_to_transformers"] = round(row["perplexity"] / hf_row["perplexity"], 6) if hf_row else None
    if hf_row is not None:
        hf_row["ratio_to_float32"] = round(hf_row["perplexity"] / ppl_none, 6) if ppl_none else None

    result = {
        "command": " ".join(["python", *sys.argv]),
        "model": args.model or "SmolLM2-135M-Instruct (default, GGUF Q4_1, Q8_0 embedding)",
        "text": {
            "path": os.path.relpath(args.text),
            "tokens": num_text_tokens,
            "window": args.window,
            "stride": args.window,
            "num_windows": len(windows),
            "scored": "every token of a window but its first",
        },
        "engine": {
            **engine_args,
            "max_model_len": args.window + KV_BLOCK_SIZE,
            "dtype": "float32",
        },
        "load_average_start": load_start,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "machine": offline.machine_info(),
        "cpu_kernels": cpu_kernels,
        "results": rows,
        "transformers": hf_row,
    }
    print()
    for row in rows:
        ratios = f"x{row['ratio_to_float32']:.5f} of float32" if row["ratio_to_float32"] else ""
        if row["ratio_to_transformers"]:
            ratios += f", x{row['ratio_to_transformers']:.5f} of transformers"
        print(f"{row['quantization']:>6}: perplexity {row['perplexity']:.4f} ({ratios})")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.output}")


if __name__ == "__main__":
    main()
