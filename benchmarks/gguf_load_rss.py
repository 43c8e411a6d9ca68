"""One engine start from a GGUF: seconds to ready and the growth of peak RSS against the weights' bytes.

`--fresh` deletes the kept conversion first, so the start converts the file (weights/converted.py); without it
the start maps what an earlier one kept. The default file is `moe_peers.py`'s OLMoE-shaped GGUF (written if
missing). Run each case in a process of its own (peak RSS only grows):

    python benchmarks/gguf_load_rss.py --fresh --output-json benchmarks/results/gguf_load_rss_fresh.json
    python benchmarks/gguf_load_rss.py --output-json benchmarks/results/gguf_load_rss_mapped.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import jax
from moe import peak_rss_bytes
from moe_peers import olmoe_gguf

from jaxllm import LLM
from jaxllm.bench.offline import machine_info
from jaxllm.weights.default import cache_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", help="default: an OLMoE-1B-7B-shaped Q4_1 file (benchmarks/moe_peers.py)")
    parser.add_argument("--fresh", action="store_true", help="delete the kept conversion of this file first")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    gguf = Path(args.gguf) if args.gguf else olmoe_gguf(cache_dir() / "gguf" / "olmoe-1b-7b-shape-random.Q4_1.gguf")
    if args.fresh:
        for folder in (cache_dir() / "weights").glob("*"):
            source = folder / "source.json"
            if source.is_file() and json.loads(source.read_text())["source"] == str(gguf):
                shutil.rmtree(folder)
    before, started = peak_rss_bytes(), time.perf_counter()
    llm = LLM(
        str(gguf),
        dtype="float32",
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_model_len=256,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        progress=False,
    )
    seconds, growth = time.perf_counter() - started, peak_rss_bytes() - before
    runner = llm.engine.runner
    weights = sum(a.nbytes for a in jax.tree.leaves(runner.params))
    kv = sum(a.nbytes for a in jax.tree.leaves(runner.cache))
    result = {
        "machine": machine_info(),
        "args": vars(args),
        "gguf_bytes": gguf.stat().st_size,
        "start_seconds": seconds,
        "peak_rss_growth_bytes": growth,
        "weights_bytes": weights,
        "kv_cache_bytes": kv,
        "peak_rss_beside_the_cache_over_weights": (growth - kv) / weights,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
