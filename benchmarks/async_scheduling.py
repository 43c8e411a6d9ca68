"""Async scheduling on vs off at batch 1: output tok/s and the step time breakdown, rounds alternating.

Both engines live in one process and take turns, round by round, so that a noisy machine weighs on both
alike; medians are reported. Per step: wall ms (elapsed / steps), `device` ms (ModelRunner.stats: the
dispatch plus the time the host is blocked waiting for results; with async on that is only what the host
work did not hide), `host` ms (wall - device: scheduling, packing, update, detokenizing), packing ms.
`--tiny` runs a 2-layer random model (a bare config, dummy weights) whose device step is short, so that
host time is a large share of the step, as on an accelerator with a quantized model.

    python benchmarks/async_scheduling.py --output-len 64 --rounds 5 [--tiny] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from jaxllm import LLM, SamplingParams

TINY = Path(__file__).parent / "configs" / "tiny-llama.json"  # 2 layers, random weights (load_format="dummy")


def watch_overlap(llm: LLM) -> dict:
    """Count launches that followed a step (async) and those made while that step was still on the device."""
    runner, seen = llm.engine.runner, {"followed": 0, "overlapped": 0}
    launch = runner.launch

    def watched(out, grammar=None, prev=None):
        if prev is not None:
            seen["followed"] += 1
            seen["overlapped"] += not prev.token_ids.is_ready()
        return launch(out, grammar, prev)

    runner.launch = watched  # type: ignore[method-assign]
    return seen


def one_round(llm: LLM, prompt: list[int], output_len: int) -> dict:
    stats = llm.engine.runner.stats
    before = stats.snapshot()
    seen = getattr(llm, "_overlap", None)
    followed, overlapped = (seen["followed"], seen["overlapped"]) if seen else (0, 0)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    steps, device_s, pack_s = (a - b for a, b in zip(stats.snapshot(), before, strict=True))
    return {
        "output_tokens_per_second": output_len / elapsed,
        "wall_ms_per_step": 1e3 * elapsed / steps,
        "device_ms_per_step": 1e3 * device_s / steps,
        "host_ms_per_step": 1e3 * (elapsed - device_s) / steps,
        "input_packing_ms_per_step": 1e3 * pack_s / steps,
        "num_steps": steps,
        # launches with a previous step in flight, and those made while it still ran (the host work hidden)
        "followed_launches": (seen["followed"] - followed) if seen else 0,
        "overlapped_launches": (seen["overlapped"] - overlapped) if seen else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer random model instead of the default one")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    model, extra = None, {}
    if args.tiny:
        model, extra = str(TINY), {"load_format": "dummy"}
    shape = dict(max_num_seqs=1, max_model_len=args.input_len + args.output_len, progress=False, **extra)
    engines = {mode: LLM(model, async_scheduling=mode == "on", **shape) for mode in ("off", "on")}
    engines["on"]._overlap = watch_overlap(engines["on"])  # type: ignore[attr-defined]
    prompt = [(7 * j) % 500 + 3 for j in range(args.input_len)]
    for llm in engines.values():  # warm: first steps pay one-time host costs
        one_round(llm, prompt, 4)
    rounds: dict[str, list[dict]] = {"off": [], "on": []}
    for index in range(args.rounds):
        for mode, llm in engines.items():
            rounds[mode].append(one_round(llm, prompt, args.output_len))
            r = rounds[mode][-1]
            print(
                f"round {index} async {mode:3}: {r['output_tokens_per_second']:.1f} tok/s, "
                f"{r['wall_ms_per_step']:.2f} ms/step (device {r['device_ms_per_step']:.2f}, "
                f"host {r['host_ms_per_step']:.2f}, packing {r['input_packing_ms_per_step']:.2f}; "
                f"{r['overlapped_launches']}/{r['followed_launches']} launches while the previous step ran)"
            )
    medians = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in rounds.items()}
    for mode, m in medians.items():
        print(
            f"median async {mode:3}: {m['output_tokens_per_second']:.1f} tok/s, {m['wall_ms_per_step']:.2f} ms/step "
            f"(device {m['device_ms_per_step']:.2f}, host {m['host_ms_per_step']:.2f}, "
            f"packing {m['input_packing_ms_per_step']:.2f})"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "medians": medians, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
