"""What `jaxllm bench throughput` and `jaxllm bench latency` share: the workload, the engine, the peers.

The workload is the peers' own: every prompt is exactly `input_len` real tokens cut from a
fixed English text (prompt i starts 7 tokens after prompt i-1, so no two share a prefix
block), greedy, EOS ignored, exactly `output_len` new tokens each. Real text, not random ids,
so that a model's attention sees what it would in use.

`--compare` runs the peers — the engines a user would otherwise pick, on the same default
model and the very same token ids — back to back with jaxllm, round by round. They are the
project's own scripts in `benchmarks/peers/`, run as subprocesses in this interpreter; each
prints one JSON line with its per-iteration latencies. A peer that is not installed is
reported as such, never fatal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILLER = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold. Knowledge is power, and time waits for no one. "
    "In the middle of difficulty lies opportunity, and the best way out is always through. "
)
PROMPT_STRIDE = 7
PEERS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
# name → the peer script and its flags. llama.cpp runs the default model's GGUF as shipped (Q4_1) and,
# like for like with jaxllm's float32 (bfloat16), the same weights dequantized to F32 (BF16) by
# llama.cpp itself; "-bf16" peers are the like for like of jaxllm's dtype="bfloat16".
PEERS = {
    "transformers": ["transformers_generate.py"],
    "llama.cpp": ["llamacpp_generate.py"],
    "llama.cpp-f32": ["llamacpp_generate.py", "--dequantize", "f32"],
    "transformers-bf16": ["transformers_generate.py", "--dtype", "bfloat16"],
    "llama.cpp-bf16": ["llamacpp_generate.py", "--dequantize", "bf16"],
}


def make_prompts(tokenizer, num_prompts: int, input_len: int) -> list[list[int]]:
    """`num_prompts` rows of exactly `input_len` token ids of the filler text, each 7 tokens after the last."""
    ids = tokenizer(FILLER * (input_len // 20 + 8), add_special_tokens=False)["input_ids"]
    while len(ids) < input_len + PROMPT_STRIDE * num_prompts + 1:
        ids = ids + ids
    return [ids[PROMPT_STRIDE * i : PROMPT_STRIDE * i + input_len] for i in range(num_prompts)]


def add_workload_args(parser: argparse.ArgumentParser, *, compare: bool = True) -> None:
    """The flags both benchmarks take besides their own shape flags and the engine's."""
    report = parser.add_argument_group("report")
    report.add_argument("--output-json", default=None, help="write the results to this JSON file")
    report.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into this folder")
    if compare:
        report.add_argument(
            "--compare",
            nargs="*",
            default=None,
            choices=sorted(PEERS),
            metavar="PEER",
            help=f"also run these peers on the same workload ({', '.join(sorted(PEERS))}; "
            "no name: all of them). Default model only",
        )
        report.add_argument(
            "--peer-threads",
            type=int,
            default=os.cpu_count() or 1,
            help="threads for the peers (default: all cores, as jaxllm uses)",
        )


def greedy_params(output_len: int):
    from jaxllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)


def make_engine(args: argparse.Namespace, *, max_num_seqs: int, max_model_len: int):
    """An `LLM` from the engine flags, sized for the workload unless the flags say otherwise."""
    from jaxllm.entrypoints.cli.common import make_llm

    defaults = {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return make_llm(args)


def run_batch(llm, prompts: list[list[int]], output_len: int) -> float:
    """Generate for all prompts at once; seconds of wall time. Checks every row got `output_len` tokens.

    The prefix cache is emptied first: runs repeat the same prompts, and a peer recomputes every
    prompt, so a timed run must too."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(output_len), use_tqdm=False)
    elapsed = time.perf_counter() - start
    short = [len(o.outputs[0].token_ids) for o in outputs if len(o.outputs[0].token_ids) != output_len]
    if short:
        raise RuntimeError(f"{len(short)} requests did not produce output_len={output_len} tokens: {short[:5]}")
    return elapsed


def check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")


def check_peer_model(args: argparse.Namespace) -> None:
    if args.compare is not None and args.model is not None:
        raise ValueError("--compare runs the peers on the default model only; drop --model to compare")
    if args.compare is not None and not PEERS_DIR.is_dir():
        raise ValueError(f"--compare needs the peer scripts in {PEERS_DIR} (a source checkout of jaxllm)")


def peer_names(args: argparse.Namespace) -> list[str]:
    if args.compare is None:
        return []
    return list(args.compare) or sorted(PEERS)


def run_peer(
    name: str,
    prompts: list[list[int]],
    output_len: int,
    *,
    num_iters: int,
    warmup_iters: int,
    threads: int,
    timeout: float = 7200.0,
) -> dict:
    """One peer script on the same token ids: `{"engine", "latencies_s", ...}` or `{"engine", "error"}`."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    script, *flags = PEERS[name]
    cmd = [
        sys.executable,
        str(PEERS_DIR / script),
        *flags,
        "--prompts",
        f.name,
        "--output-len",
        str(output_len),
        "--num-iters",
        str(num_iters),
        "--num-iters-warmup",
        str(warmup_iters),
        "--threads",
        str(threads),
    ]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(f.name)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        return {"engine": name, "error": (result.stderr.strip() or result.stdout.strip())[-600:]}
    return json.loads(lines[-1])


def median_ratio(ours: list[float], theirs: list[float]) -> float | None:
    """Median over rounds of ours/theirs: each round's pair ran back to back, so machine noise cancels."""
    pairs = [a / b for a, b in zip(ours, theirs, strict=True) if b]
    return round(statistics.median(pairs), 3) if pairs else None


def write_json(result: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {path}")


def cpu_kernel_info(llm) -> dict | None:
    """The C++ CPU kernels the engine's step runs (None off the CPU): the choice in words, and from the
    self-check the kernel's speed-up over XLA's path per timed case (>1: the kernel is faster), and where timed the
    quantized kernel's integer path over its float-activation one."""
    choice = llm.engine.runner.cpu_kernels
    if choice is None:
        return None
    timed = [(f"{what}_{case}", times) for what, cases in choice.timings_ms.items() for case, times in cases.items()]
    info = {
        "choice": choice.describe(),
        "target": choice.target,
        "int8_min_rows": choice.int8_min_rows,
        "kernel_over_xla": {name: round(times[1] / times[0], 2) for name, times in timed},
    }
    if int8 := {name: round(times[0] / times[2], 2) for name, times in timed if len(times) > 2}:
        info["int8_over_float"] = int8
    return info


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or what `platform` knows."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import platform

    import jax

    info = {
        "cpus": os.cpu_count(),
        "cpu": cpu_name(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    if info["backend"] == "cpu":
        from pallas_kernels import cpu_ffi

        info["isa"] = cpu_ffi.isa()  # the vector ISA the C++ kernels are built for
    return info


def speculative_config(args: argparse.Namespace) -> dict | None:
    """`--speculative-config` as validated (defaults filled in), None without speculation."""
    from jaxllm.engine.args import EngineArgs

    config = EngineArgs.from_cli_args(args).speculative()
    return json.loads(config.to_json()) if config is not None else None


def spec_decode_totals(llm) -> dict | None:
    """The engine cores' speculation counters (running totals, replicas summed), None without speculation."""
    from jaxllm.metrics.offline import engine_stats
    from jaxllm.metrics.stats import sum_engine_stats

    totals = sum_engine_stats(engine_stats(llm.engine))
    return totals if "spec_decode_num_drafts" in totals else None


def spec_decode_result(totals: dict | None, before: dict | None) -> dict | None:
    """Speculation between two `spec_decode_totals`, for a benchmark's JSON: the counts, acceptance rate and mean
    acceptance length (vLLM's definitions, `jaxllm.metrics.stats.spec_decode_summary`), rates rounded."""
    from jaxllm.metrics.stats import spec_decode_summary

    if totals is None:
        return None
    summary = spec_decode_summary(totals, before)
    assert summary is not None
    for key in ("acceptance_rate", "mean_acceptance_length"):
        if summary[key] is not None:
            summary[key] = round(summary[key], 4)
    if summary["per_position_acceptance_rate"] is not None:
        summary["per_position_acceptance_rate"] = [round(r, 4) for r in summary["per_position_acceptance_rate"]]
    return summary
