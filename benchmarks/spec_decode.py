#!/usr/bin/env python
"""Speculative decoding, measured: output tok/s with and without it, in alternated rounds of one run.

Two engines (one per configuration, loaded once, shared by every round): no speculation, and the
`--speculative-config` one (default n-gram, k = 4, prompt lookup 2..4). Workloads (issue 27):

- `copy`: batch 1, an input-grounded task: chat prompts asking the model to repeat a paragraph (100-200
  tokens, a few typos) with its spelling fixed; greedy, `--output-len` tokens at most (EOS ends a request:
  output tokens are reported). Goal: >= 2.0x.
- `chat`: batch 1, plain questions (no copying), as above. Goal: >= 1.0x.
- `batch<B>` for each of `--batches` (default 32 and 64): the throughput workload of `jaxllm bench
  throughput` (`--input-len` filler tokens, exactly `--output-len` greedy tokens, EOS ignored), all B at once.
  Goal: >= 0.95x (the load-aware rule on; issue 44: >= 0.98x at B = max_num_seqs = 32, where the rule may
  rightly decline on a compute-bound CPU).

Batch-1 workloads also report the rate after each first token (`decode_ratios`): the prompt's prefill is the
same with and without speculation, and on the default Q4_1 model it is a quarter of the copy task's time.
`--simulate B` (default 32) runs B requests at once with max_num_seqs B through the simulator (the engine's own
Scheduler and load-aware rule) on a memory-bound device's cost model and on the CPU's measured one.

Each round runs every workload on both engines back to back, the order alternating from round to round
(round 0: no speculation first); the ratios are spec / no-spec per round, reported with their median. With
speculation, the engine's spec_decode counters over the workload give the acceptance rate (accepted / draft
tokens) and the mean acceptance length (1 + accepted / drafts, vLLM's definitions), and the drafter's
`propose` is timed from outside (wrapped here: the host time a step adds by proposing, per engine step).
Greedy outputs must be the same with and without speculation: `identical_outputs` says whether they were.

    python benchmarks/spec_decode.py --rounds 3 --output benchmarks/results/spec_decode_cpu.json
    python benchmarks/spec_decode.py --rounds 3 --batches 32 --max-num-seqs 32 \
        --output benchmarks/results/spec_decode_q4_1.json                          # issue 44: a full batch
    python benchmarks/spec_decode.py --rounds 1 --batches 1 --output-len 16          # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
GOALS = {"copy": 2.0, "chat": 0.95}  # issue 44's; batch workloads: BATCH_GOAL (where the rule may rightly decline)
BATCH_GOAL = 0.98

# a few typos each, so that "fix" has something to do; ~100-200 tokens each
PARAGRAPHS = [
    "The village of Eastwick sits at the bend of a slow river, where the water turns brown after every storm. "
    "Most of the houses were built from the grey stone of the old quarry, and their roofs are covered in moss "
    "that nobody has bothered to remove for decades. On market days the square fills with farmers selling "
    "cheese, apples and honey, and the baker opens his shop an hour earlyer than usual. In the evenings the "
    "old men gather outside the inn to argue about the weather, the price of wool, and wether the bridge will "
    "survive another winter.",
    "To reset the router, first unplug it from the wall and wait at least thirty seconds. While you wait, check "
    "that the cable from the modem is firmly connected to the port marked WAN, not to one of the yellow ports. "
    "Plug the router back in and wait for the power light to turn solid green; this can take up to two minutes. "
    "If the light keeps blinking orange, press and hold the small reset button on the back with a paperclip for "
    "ten seconds. The router will restart with its factory settings, so you will need to enter the network name "
    "and pasword again from the sticker on the bottom.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Inside the leaf, "
    "chlorophyll absorbs mostly red and blue light and reflects green, which is why leaves look green to us. "
    "The energy of the absorbed light is used to split water molecules, releasing oxygen as a by-product. The "
    "plant then uses carbon dioxide from the air to build sugars, which it stores or burns for growth. Without "
    "this process there would be almost no oxygen in the atmosphere and very little food for animals, including "
    "ourselfs.",
    "Dear Ms. Thompson, thank you for your letter of the twelfth of March regarding the delayed delivery of your "
    "order. I am sorry that the parcel did not arrive on the date we promised. Our warehouse had a problem with "
    "its sorting machine during that week, and several hundred orders were held back. Your order left the "
    "warehouse yesterday and should reach you within three working days. As an apology, we have refunded the "
    "shipping cost to your card. Please do not hesitate to contact me if there is anything else I can do for "
    "you. Yours sincerly, Daniel Reyes, Customer Service.",
]
COPY_INSTRUCTION = "Repeat the following text exactly, fixing only its spelling mistakes:\n\n"
QUESTIONS = [
    "What are the main causes of inflation, and how do central banks try to control it?",
    "Give me some tips for getting better sleep.",
    "Why is the sky blue? Explain it simply.",
    "What should I consider when choosing a programming language for a new project?",
]


# ---- the engines ------------------------------------------------------------------------------------------


class ProposeTimer:
    """Times the engine's `drafter.propose` (all the host work a step adds to propose drafts) without touching
    the engine: the drafter's bound method is replaced, on this instance only, by a timed wrapper."""

    def __init__(self, drafter):
        self.seconds = 0.0
        self.calls = 0
        inner = drafter.propose

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        drafter.propose = timed


def make_engine(args, speculative: dict | None, max_model_len: int):
    from jaxllm import LLM

    engine_args = {
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": max_model_len,
        "dtype": args.dtype,
    }
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    started = time.perf_counter()
    llm = LLM(progress=False, speculative_config=speculative, **engine_args)
    seconds = time.perf_counter() - started
    drafter = getattr(llm.engine, "drafter", None)
    timer = ProposeTimer(drafter) if drafter is not None else None
    return llm, timer, seconds


def counters(llm, timer: ProposeTimer | None) -> dict:
    stats = llm.engine.stats()
    return {
        "steps": stats["num_steps"],
        "propose_s": timer.seconds if timer is not None else 0.0,
        "drafter_s": getattr(llm.engine.drafter, "propose_seconds", 0.0) if timer is not None else 0.0,
        "stats": stats,
    }


# ---- one workload on one engine ---------------------------------------------------------------------------


def run_singles(llm, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]], float]:
    """Batch 1: each prompt alone, greedy, up to `output_len` tokens (EOS ends it); seconds of generate calls,
    the outputs, and seconds from each first token to its last (the decode, without the prompt's prefill)."""
    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    llm.reset_prefix_cache()
    elapsed, outputs, decode = 0.0, [], 0.0
    for ids in prompts:
        started = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        elapsed += time.perf_counter() - started
        outputs.append(list(out[0].outputs[0].token_ids))
        metrics = out[0].metrics
        if metrics is not None and metrics.first_token_time is not None and metrics.last_token_time is not None:
            decode += metrics.last_token_time - metrics.first_token_time
    return elapsed, outputs, decode


def run_workload(llm, timer, workload: dict, output_len: int) -> dict:
    from jaxllm.bench import offline

    before = counters(llm, timer)
    decode = None
    if workload["batch"] == 1:
        elapsed, outputs, decode = run_singles(llm, workload["prompts"], output_len)
    else:
        elapsed = offline.run_batch(llm, workload["prompts"], output_len)
        outputs = None  # run_batch checks every row got exactly output_len tokens
    after = counters(llm, timer)
    tokens = sum(len(o) for o in outputs) if outputs is not None else len(workload["prompts"]) * output_len
    steps = after["steps"] - before["steps"]
    row = {
        "elapsed_s": round(elapsed, 4),
        "output_tokens": tokens,
        "output_tokens_per_second": round(tokens / elapsed, 3),
        "steps": steps,
        "tokens_per_step": round(tokens / max(steps, 1), 3),
        "_outputs": outputs,
    }
    if decode:  # batch 1: the tokens after each first one over the time after it (the prefill left out)
        row["decode_tokens_per_second"] = round((tokens - len(workload["prompts"])) / decode, 3)
    if timer is not None:  # the speculating engine
        row["spec_decode"] = offline.spec_decode_result(offline.spec_decode_totals(llm), before["stats"])
        row["propose_s"] = round(after["propose_s"] - before["propose_s"], 6)
        row["drafter_propose_s"] = round(after["drafter_s"] - before["drafter_s"], 6)
        row["propose_ms_per_step"] = round(1e3 * row["propose_s"] / max(steps, 1), 4)
    return row


# ---- the report -------------------------------------------------------------------------------------------


def summarize(name: str, workload: dict, rounds: list[dict]) -> dict:
    base = [r["no_spec"]["output_tokens_per_second"] for r in rounds]
    spec = [r["spec"]["output_tokens_per_second"] for r in rounds]
    ratios = [round(s / b, 4) for s, b in zip(spec, base, strict=True)]
    decode = [
        round(r["spec"]["decode_tokens_per_second"] / r["no_spec"]["decode_tokens_per_second"], 4)
        for r in rounds
        if "decode_tokens_per_second" in r["spec"] and "decode_tokens_per_second" in r["no_spec"]
    ]
    goal = GOALS.get(name, BATCH_GOAL)
    drafts = sum(r["spec"]["spec_decode"]["num_drafts"] for r in rounds)
    draft_tokens = sum(r["spec"]["spec_decode"]["num_draft_tokens"] for r in rounds)
    accepted = sum(r["spec"]["spec_decode"]["num_accepted_tokens"] for r in rounds)
    steps = sum(r["spec"]["steps"] for r in rounds)
    propose_s = sum(r["spec"]["propose_s"] for r in rounds)
    identical = [r["no_spec"]["_outputs"] == r["spec"]["_outputs"] for r in rounds if r["spec"]["_outputs"]]
    return {
        "workload": name,
        "batch": workload["batch"],
        "num_prompts": len(workload["prompts"]),
        "prompt_tokens": [len(p) for p in workload["prompts"]] if workload["batch"] == 1 else workload["input_len"],
        "ignore_eos": workload["batch"] != 1,
        "no_spec_output_tok_s_median": round(statistics.median(base), 3),
        "spec_output_tok_s_median": round(statistics.median(spec), 3),
        "ratios": ratios,
        "ratio_median": round(statistics.median(ratios), 4),
        "goal": goal,
        "meets_goal": statistics.median(ratios) >= goal,
        "decode_ratios": decode or None,  # batch 1: after the first token (the same prefill left out of both)
        "decode_ratio_median": round(statistics.median(decode), 4) if decode else None,
        "output_tokens": {
            "no_spec": [r["no_spec"]["output_tokens"] for r in rounds],
            "spec": [r["spec"]["output_tokens"] for r in rounds],
        },
        "identical_outputs": all(identical) if identical else None,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "steps": {"no_spec": [r["no_spec"]["steps"] for r in rounds], "spec": [r["spec"]["steps"] for r in rounds]},
        "propose_ms_per_step": round(1e3 * propose_s / max(steps, 1), 4),
        "rounds": [{k: {x: y for x, y in v.items() if x != "_outputs"} for k, v in r.items()} for r in rounds],
    }


def format_summary(s: dict) -> str:
    rate = f"{100 * s['acceptance_rate']:.1f}%" if s["acceptance_rate"] is not None else "-"
    length = f"{s['mean_acceptance_length']:.2f}" if s["mean_acceptance_length"] is not None else "-"
    return (
        f"{s['workload']:>8} (B={s['batch']}): no spec {s['no_spec_output_tok_s_median']:.1f} tok/s, "
        f"spec {s['spec_output_tok_s_median']:.1f} tok/s, ratio {s['ratio_median']:.2f}x "
        f"(rounds {', '.join(f'{r:.2f}' for r in s['ratios'])}; goal {s['goal']}x: "
        f"{'met' if s['meets_goal'] else 'NOT met'}); after the first token {s['decode_ratio_median']}x; "
        f"acceptance {rate}, mean length {length}, "
        f"proposing {s['propose_ms_per_step']:.3f} ms/step; identical outputs: {s['identical_outputs']}"
    )


# ---- the simulator: a full batch on a memory-bound device's cost model --------------------------------------

# a step that reads every weight once whatever its rows (decode on a GPU at batch 32-64): a 7 ms floor, then 10 us
# per token of compute, 2 us per row of logits; the CPU's shipped cost model (measured, compute-bound) beside it
MEMORY_BOUND = ([1, 1024], [0.007, 0.007 + 1024 * 1e-5], 2e-6)  # bucket tokens, their base seconds, per row
CPU_COST = Path(__file__).resolve().parent.parent / "examples" / "research" / "cost_cpu.json"


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def simulate_full_batch(spec: dict, batch: int, input_len: int, output_len: int, acceptance: list[float]) -> dict:
    """`batch` requests at once with max_num_seqs = batch (a full batch), without and with speculation, through
    the simulator (the engine's own Scheduler and load-aware rule), on each cost model: output tokens per
    simulated second, the ratio, and what the rule chose (speculated fraction, drafts per verification)."""
    from jaxllm.config import SchedulerConfig, SpeculativeConfig
    from jaxllm.scheduler_output import max_logits_rows
    from jaxllm.sim.costmodel import CostModel
    from jaxllm.sim.simulator import SimConfig, cost_model_step_time, simulate
    from jaxllm.sim.trace import TraceRequest

    speculative = SpeculativeConfig.parse(spec)
    sched = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=512, max_model_len=input_len + output_len + 8)
    trace = [TraceRequest(0.0, output_len, prompt_len=input_len) for _ in range(batch)]
    blocks = batch * (-(-(input_len + output_len + 8) // 16)) + 1
    buckets, base_s, per_row_s = MEMORY_BOUND
    memory_bound = CostModel(bucket_tokens=buckets, bucket_base_s=base_s, per_seq_s=per_row_s)
    models = {"memory_bound": memory_bound, "cpu_measured": CostModel.load(CPU_COST)}
    rows = {"rows_of_logits": max_logits_rows(sched, speculative), "max_num_seqs": batch}
    results = []
    for name, cost in models.items():
        plain_config = SimConfig(sched, blocks)
        plain = simulate(trace, plain_config, cost_model_step_time(cost, plain_config))
        base = batch * output_len / plain.duration
        for rate in acceptance:
            config = SimConfig(sched, blocks, speculative=speculative)
            result = simulate(trace, config, cost_model_step_time(cost, config), acceptance_rate=rate)
            tok_s = batch * output_len / result.duration
            results.append(
                {
                    "cost_model": name,
                    "acceptance_rate": rate,
                    "no_spec_tok_s": round(base, 1),
                    "spec_tok_s": round(tok_s, 1),
                    "ratio": round(tok_s / base, 3),
                    "steps": {"no_spec": plain.num_steps, "spec": result.num_steps},
                    "speculated_fraction": _rounded(result.extra.get("spec_decode_speculated_fraction")),
                    "mean_draft_tokens": _rounded(result.extra.get("spec_decode_mean_draft_tokens")),
                }
            )
    return {"batch": batch, "input_len": input_len, "output_len": output_len, **rows, "results": results}


# ---- main -------------------------------------------------------------------------------------------------


def build_workloads(tokenizer, args) -> dict[str, dict]:
    from jaxllm.bench import offline

    def chat_ids(text: str) -> list[int]:
        conversation = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(prompt, add_special_tokens=False)

    workloads: dict[str, dict] = {}
    if "copy" in args.workloads:
        workloads["copy"] = {"batch": 1, "prompts": [chat_ids(COPY_INSTRUCTION + p) for p in PARAGRAPHS]}
    if "chat" in args.workloads:
        workloads["chat"] = {"batch": 1, "prompts": [chat_ids(q) for q in QUESTIONS]}
    if "batch" in args.workloads:
        for b in args.batches:
            prompts = offline.make_prompts(tokenizer, b, args.input_len)
            workloads[f"batch{b}"] = {"batch": b, "prompts": prompts, "input_len": args.input_len}
    return workloads


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    parser.add_argument(
        "--speculative-config",
        default=json.dumps(DEFAULT_SPEC),
        help=f"the speculating engine's speculative_config, vLLM's JSON (default {json.dumps(DEFAULT_SPEC)})",
    )
    parser.add_argument("--workloads", nargs="+", default=["copy", "chat", "batch"], choices=["copy", "chat", "batch"])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64], help="batch sizes of the batch workload")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens of the batch workload")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (at most, for batch 1)")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="both engines' max_num_seqs (default: the engine's). A step has rows of logits for k + 1 per sequence "
        "(within max_num_batched_tokens), so a batch of max_num_seqs still gets rows for its drafts and the "
        "load-aware rule decides how many to use",
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--simulate",
        type=int,
        default=32,
        metavar="B",
        help="also simulate B requests at once with max_num_seqs B on a memory-bound cost model and on the CPU's "
        "(examples/research/cost_cpu.json), acceptance 0.5 / 0.7 / 0.9 (default 32; 0: not)",
    )
    parser.add_argument("--output", default=None, help="write the result JSON here")
    args = parser.parse_args()
    if min(args.rounds, args.output_len, args.input_len, *args.batches, args.max_num_seqs or 1) < 1:
        parser.error("--rounds, --output-len, --input-len, --batches and --max-num-seqs must be >= 1")

    from jaxllm.bench import offline
    from jaxllm.config import SpeculativeConfig

    try:
        speculative = SpeculativeConfig.parse(args.speculative_config)
    except ValueError as e:
        parser.error(str(e))
    assert speculative is not None
    spec_json = json.loads(speculative.to_json())
    load_start = [round(x, 2) for x in os.getloadavg()]

    # max_model_len 512 holds every prompt and 128 tokens; longer outputs (rare) start the engine again
    no_spec, _, no_spec_start = make_engine(args, None, 512)
    workloads = build_workloads(no_spec.get_tokenizer(), args)
    max_model_len = max(512, max(len(p) for w in workloads.values() for p in w["prompts"]) + args.output_len)
    if max_model_len > 512:
        del no_spec
        no_spec, _, no_spec_start = make_engine(args, None, max_model_len)
    spec, timer, spec_start = make_engine(args, spec_json, max_model_len)
    engines = {"no_spec": (no_spec, None), "spec": (spec, timer)}
    print(f"engines ready: no spec {no_spec_start:.1f}s, spec {spec_start:.1f}s; max_model_len {max_model_len}")

    # warm-up, untimed: first steps pay one-time host costs, and the load-aware rule measures the step sizes it
    # may choose (a one-time cost per engine: at a full batch, a few steps of up to 5x the rows)
    for llm, t in engines.values():
        for w in workloads.values():
            prompts = w["prompts"] if w["batch"] > 1 else w["prompts"][:2]
            run_workload(llm, t, {**w, "prompts": prompts}, min(16, args.output_len))

    rounds: dict[str, list[dict]] = {name: [] for name in workloads}
    started = time.perf_counter()
    for index in range(args.rounds):
        order = ["no_spec", "spec"] if index % 2 == 0 else ["spec", "no_spec"]
        for name, w in workloads.items():
            row = {kind: run_workload(*engines[kind], w, args.output_len) for kind in order}
            rounds[name].append({"no_spec": row["no_spec"], "spec": row["spec"]})
            print(
                f"round {index} {name}: no spec {row['no_spec']['output_tokens_per_second']:.1f} tok/s, "
                f"spec {row['spec']['output_tokens_per_second']:.1f} tok/s "
                f"({row['spec']['output_tokens_per_second'] / row['no_spec']['output_tokens_per_second']:.2f}x)"
            )
    summaries = [summarize(name, workloads[name], rounds[name]) for name in workloads]
    simulated = None
    if args.simulate:
        simulated = simulate_full_batch(spec_json, args.simulate, args.input_len, args.output_len, [0.5, 0.7, 0.9])
    result = {
        "speculative_config": spec_json,
        "rounds": args.rounds,
        "output_len": args.output_len,
        "engine": {"max_num_seqs": args.max_num_seqs, "max_model_len": max_model_len, "dtype": args.dtype},
        "startup_seconds": {"no_spec": round(no_spec_start, 2), "spec": round(spec_start, 2)},
        "wall_seconds": round(time.perf_counter() - started, 1),
        "load_average_start": load_start,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "machine": offline.machine_info(),
        "cpu_kernels": offline.cpu_kernel_info(spec),
        "workloads": summaries,
        "full_batch_simulation": simulated,
    }
    print()
    for s in summaries:
        print(format_summary(s))
    if simulated is not None:
        print(
            f"simulated, {simulated['batch']} at once, max_num_seqs {simulated['max_num_seqs']}, rows of logits "
            f"{simulated['rows_of_logits']}:"
        )
        for r in simulated["results"]:
            print(
                f"  {r['cost_model']:>12}, acceptance {r['acceptance_rate']}: {r['no_spec_tok_s']} -> "
                f"{r['spec_tok_s']} tok/s ({r['ratio']}x), speculated {r['speculated_fraction']}, "
                f"drafts {r['mean_draft_tokens']}"
            )
    print(f"load average: start {result['load_average_start']}, end {result['load_average_end']}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.output}")


if __name__ == "__main__":
    main()
