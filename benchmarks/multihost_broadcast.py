"""Per-step cost of the multi-host leader's broadcast (header + one bucket's padded inputs).

Starts NNODES local processes (gloo on loopback, one CPU device each), builds the real
`InputBatch` and buckets for the given engine shapes, and times what `StepLeader` does each
step: pack the inputs, `broadcast_one_to_all` the header, then the packed bucket payload —
light (no row uses penalties or masks) and full. Prints one JSON line per case; `--output`
also writes them all to a JSON file.

    python benchmarks/multihost_broadcast.py --num-seqs 64 256 --steps 20 \
        --output benchmarks/results/multihost_broadcast_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def node(rank: int, args) -> None:
    import jax

    from jaxllm.distributed.runtime import initialize

    initialize(args.nnodes, rank, "127.0.0.1", args.port, tensor_parallel_size=args.nnodes, timeout=120)
    import numpy as np
    from jax.experimental.multihost_utils import broadcast_one_to_all

    from jaxllm.distributed.step_sync import HEADER_SIZE, Payloads
    from jaxllm.runner.buckets import make_buckets
    from jaxllm.runner.input_batch import InputBatch
    from jaxllm.scheduler_output import SchedulerOutput

    rows = []
    for num_seqs in args.num_seqs:
        runner = argparse.Namespace(buckets=[b for b in make_buckets(num_seqs, num_seqs) if b.num_seqs == num_seqs])
        largest = runner.buckets[-1]
        runner.batch = InputBatch(
            largest.num_tokens, largest.num_seqs, -(-args.max_model_len // 16), args.max_model_len, args.vocab_size, 16
        )
        payloads = Payloads(runner)
        payloads.warm_up()
        inputs, sampling = runner.batch.fill(SchedulerOutput(step=-1), largest)
        for full in (False, True):
            if full:  # one row with penalties makes the leader send the token history and masks too
                sampling = sampling._replace(history=sampling.history.copy())
                sampling.history[0, 0] = 1
            times = []
            for _ in range(args.steps):
                started = time.perf_counter()
                is_full, buffer = payloads.pack(inputs, sampling)
                broadcast_one_to_all(np.array([1, 0, 0, int(is_full)], np.int32))
                broadcast_one_to_all(buffer)
                times.append(time.perf_counter() - started)
            assert is_full == full
            rows.append(
                {
                    "num_seqs": num_seqs,
                    "num_tokens": largest.num_tokens,
                    "nnodes": args.nnodes,
                    "payload": "full" if full else "light",
                    "max_model_len": args.max_model_len,
                    "vocab_size": args.vocab_size,
                    "bytes_per_step": buffer.nbytes + HEADER_SIZE * 4,
                    "ms_per_step_median": round(1000 * sorted(times)[len(times) // 2], 3),
                    "ms_per_step_min": round(1000 * min(times), 3),
                    "load_average": os.getloadavg()[0],
                }
            )
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0 and args.output:
        with open(args.output, "w") as f:
            json.dump({"steps": args.steps, "results": rows}, f, indent=1)
    jax.distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nnodes", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=49152)  # SmolLM2
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--output", default=None, help="also write the results to this JSON file")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return node(args.rank, args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(r), "--port", str(port)], env=env)
        for r in range(args.nnodes)
    ]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
