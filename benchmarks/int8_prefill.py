#!/usr/bin/env python
"""Time to first token of one long prompt: the quantized kernel's integer path against its float-activation path,
and llama.cpp on the same GGUF file, in the same run.

One prompt of `--prompt-len` tokens (the held-out text's), one greedy token (`max_tokens=1`), the default model in
its own Q4_1 / Q8_0 blocks. jaxllm runs two engines in one process, `JAXLLM_CPU_INT8_DOT=auto` (the self-check's
choice: the integer path where it wins) and `off`, with the prefix cache off so every round prefills the whole
prompt; llama.cpp (llama-cpp-python, one batch of `--prompt-len`) decodes the same token ids. The three take turns
round by round; reported: each one's median TTFT and the median of per-round ratios to the float-activation path.

    python benchmarks/int8_prefill.py --rounds 5 --out benchmarks/results/int8_prefill_cpu.json
    python benchmarks/int8_prefill.py --rounds 5 --peers          # jaxllm alone (llama-cpp-python not installed)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))


def engine(int8_dot: str, prompt_len: int):
    from jaxllm import LLM

    os.environ["JAXLLM_CPU_INT8_DOT"] = int8_dot
    return LLM(
        progress=False, max_model_len=prompt_len + 16, max_num_seqs=1, enable_prefix_caching=False, dtype="float32"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--peers", nargs="*", default=["llama.cpp"], choices=["llama.cpp"], help="(none: jaxllm alone)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from jaxllm import SamplingParams
    from jaxllm.bench import offline
    from jaxllm.weights.default import default_model_path

    engines = {"int8_dot_auto": engine("auto", args.prompt_len), "int8_dot_off": engine("off", args.prompt_len)}
    text = (HERE.parent / "tests" / "data" / "heldout.txt").read_text()
    prompt = engines["int8_dot_off"].get_tokenizer().encode(text, add_special_tokens=False)
    while len(prompt) < args.prompt_len:
        prompt += prompt
    prompt = prompt[: args.prompt_len]
    once = SamplingParams(temperature=0, max_tokens=1)

    def jaxllm_ttft(llm) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], once, use_tqdm=False)
        return time.perf_counter() - start

    runs = {name: (lambda llm=llm: jaxllm_ttft(llm)) for name, llm in engines.items()}
    if "llama.cpp" in args.peers:
        import llama_cpp
        from llamacpp_generate import BatchedDecoder

        llamacpp = BatchedDecoder(llama_cpp, str(default_model_path()), 1, args.prompt_len + 16, args.threads, 1024)

        def llamacpp_ttft() -> float:
            llamacpp.generate([prompt], 1)
            return llamacpp.prefill_s

        runs["llama.cpp"] = llamacpp_ttft
    for run in runs.values():  # warm: compile, caches
        run()
    rounds = []
    for index in range(args.rounds):
        row = {name: round(run(), 4) for name, run in runs.items()}
        print(json.dumps({"round": index, **row}), file=sys.stderr, flush=True)
        rounds.append(row)
    summary = {
        name: {
            "ttft_s": round(statistics.median(r[name] for r in rounds), 4),
            "over_float_path": offline.median_ratio([r[name] for r in rounds], [r["int8_dot_off"] for r in rounds]),
        }
        for name in runs
    }
    report = {
        "workload": {"prompt_len": args.prompt_len, "rounds": args.rounds},
        "machine": offline.machine_info(),
        "cpu_kernels": {name: offline.cpu_kernel_info(llm) for name, llm in engines.items()},
        "rounds": rounds,
        "summary": summary,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
