"""Offline throughput (vLLM's `bench throughput`): requests/s and tokens/s of `LLM.generate` on a fixed batch.

All `--num-prompts` prompts of `--input-len` tokens go to one `LLM.generate` call, each asking
for exactly `--output-len` greedy tokens (EOS ignored); elapsed time covers the whole call.
Reported as vLLM does: requests/s, total tokens/s (prompt + output), output tokens/s, and
besides: engine steps, mean device time per step and host time per step (everything that is
not the compiled step: scheduling, input packing, detokenization). With `--rounds R` the run
repeats; medians are reported. `--compare` runs the peers after jaxllm in every round and
reports the median of the per-round ratios. With `--speculative-config JSON` (vLLM's, e.g.
'{"method": "ngram", "num_speculative_tokens": 4}') the engine speculates, and the report adds
the acceptance rate and mean acceptance length over the timed rounds (`spec_decode`).

    jaxllm bench throughput --input-len 128 --output-len 128 --num-prompts 64 --compare --rounds 3
"""

from __future__ import annotations

import argparse
import statistics

from jaxllm.bench import offline
from jaxllm.engine.args import EngineArgs
from jaxllm.metrics.loggers import format_spec_decode


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("workload")
    shape.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    shape.add_argument("--output-len", type=int, default=128, help="generated tokens per request (EOS ignored)")
    shape.add_argument("--num-prompts", type=int, default=64, help="requests, all submitted at once")
    shape.add_argument("--rounds", type=int, default=1, help="repeat the run; report medians")
    offline.add_workload_args(parser)
    EngineArgs.add_cli_args(parser)


def validate(args: argparse.Namespace) -> None:
    offline.check_positive(args, "input_len", "output_len", "num_prompts", "rounds")
    offline.check_peer_model(args)
    offline.speculative_config(args)  # a bad --speculative-config fails before anything loads


def jaxllm_run(llm, prompts: list[list[int]], output_len: int) -> dict:
    stats = llm.engine.runner.stats
    before, spec_before = stats.snapshot(), offline.spec_decode_totals(llm)
    elapsed = offline.run_batch(llm, prompts, output_len)
    steps, device_s, pack_s = (a - b for a, b in zip(stats.snapshot(), before, strict=True))
    spec = offline.spec_decode_result(offline.spec_decode_totals(llm), spec_before)
    num_prompts, input_len = len(prompts), len(prompts[0])
    return {
        "elapsed_time": round(elapsed, 4),
        "num_requests": num_prompts,
        "total_num_tokens": num_prompts * (input_len + output_len),
        "total_output_tokens": num_prompts * output_len,
        "requests_per_second": num_prompts / elapsed,
        "tokens_per_second": num_prompts * (input_len + output_len) / elapsed,
        "output_tokens_per_second": num_prompts * output_len / elapsed,
        "num_steps": steps,
        "device_ms_per_step": 1e3 * device_s / max(steps, 1),
        "input_packing_ms_per_step": 1e3 * pack_s / max(steps, 1),
        "host_ms_per_step": 1e3 * (elapsed - device_s) / max(steps, 1),
        **({"spec_decode": spec} if spec is not None else {}),
    }


def main(args: argparse.Namespace) -> dict:
    validate(args)
    llm = offline.make_engine(args, max_num_seqs=args.num_prompts, max_model_len=args.input_len + args.output_len)
    prompts = offline.make_prompts(llm.get_tokenizer(), args.num_prompts, args.input_len)
    offline.run_batch(llm, prompts[:2], 2)  # first steps pay one-time host costs; keep them out of the timing
    peers = offline.peer_names(args)
    spec_before = offline.spec_decode_totals(llm)
    rounds = []
    for index in range(args.rounds):
        row = {"round": index, "jaxllm": jaxllm_run(llm, prompts, args.output_len)}
        for peer in peers:
            row[peer] = offline.run_peer(
                peer, prompts, args.output_len, num_iters=1, warmup_iters=1, threads=args.peer_threads
            )
        rounds.append(row)
        print(_round_line(row, peers))
    result = summarize(args, rounds, peers)
    if (spec := offline.spec_decode_result(offline.spec_decode_totals(llm), spec_before)) is not None:
        result["speculative_config"] = offline.speculative_config(args)
        result["spec_decode"] = spec  # over all timed rounds
    result["cpu_kernels"] = offline.cpu_kernel_info(llm)
    print(format_result(result))
    offline.write_json(result, args.output_json)
    if args.plot:
        from jaxllm.bench.offline_plots import plot_throughput

        print(f"plot written to {plot_throughput(result, args.plot)}")
    return result


def _peer_tok_s(entry: dict) -> float | None:
    return entry.get("output_tokens_per_second") if "error" not in entry else None


def summarize(args: argparse.Namespace, rounds: list[dict], peers: list[str]) -> dict:
    """vLLM's keys, as medians over rounds, plus every round and the peers' medians and ratios."""
    counts = ("num_requests", "total_num_tokens", "total_output_tokens")
    keys = [k for k, v in rounds[0]["jaxllm"].items() if k not in counts and isinstance(v, (int, float))]
    ours = [r["jaxllm"] for r in rounds]
    result = {
        **{k: ours[0][k] for k in counts},
        **{k: round(statistics.median(o[k] for o in ours), 4) for k in keys},
    }
    result["workload"] = {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "rounds": args.rounds,
    }
    result["machine"] = offline.machine_info()
    comparison = {}
    for peer in peers:
        theirs = [_peer_tok_s(r[peer]) for r in rounds]
        ok = [(o["output_tokens_per_second"], t) for o, t in zip(ours, theirs, strict=True) if t]
        comparison[peer] = {
            "output_tokens_per_second": round(statistics.median(t for _, t in ok), 2) if ok else None,
            "ratio": offline.median_ratio([a for a, _ in ok], [b for _, b in ok]),
            "errors": [r[peer]["error"] for r in rounds if "error" in r[peer]],
        }
    if comparison:
        result["comparison"] = comparison
    result["rounds"] = rounds
    return result


def _round_line(row: dict, peers: list[str]) -> str:
    parts = [f"round {row['round']}: jaxllm {row['jaxllm']['output_tokens_per_second']:.1f} output tok/s"]
    for peer in peers:
        tok_s = _peer_tok_s(row[peer])
        parts.append(f"{peer} {tok_s:.1f}" if tok_s else f"{peer} failed")
    return ", ".join(parts)


def format_result(result: dict) -> str:
    lines = [
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s",
        f"Steps: {result['num_steps']:.0f}, device {result['device_ms_per_step']:.2f} ms/step, "
        f"host {result['host_ms_per_step']:.2f} ms/step (input packing {result['input_packing_ms_per_step']:.2f})",
    ]
    if "spec_decode" in result:
        lines.append(format_spec_decode(result["spec_decode"]))
    for peer, entry in result.get("comparison", {}).items():
        if entry["output_tokens_per_second"] is None:
            lines.append(f"{peer}: failed ({entry['errors'][0].splitlines()[-1] if entry['errors'] else '?'})")
        else:
            lines.append(
                f"{peer}: {entry['output_tokens_per_second']:.2f} output tokens/s; "
                f"jaxllm / {peer} = {entry['ratio']:.2f}x (median of per-round ratios)"
            )
    return "\n".join(lines)
