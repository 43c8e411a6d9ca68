#!/usr/bin/env python
"""Where a compiled step's time goes: the model's forward beside the bare matmul chain of the same shapes.

With dummy weights of a model (default: the default model), it times, median of `--reps`:
- `forward`: the engine's model (`runner.step_model`: its backends, weights packed as the
  loader packs them) on a decode batch of T sequences of one new token each, every
  sequence at context `--context` (what an engine step runs, minus sampling);
- `chain_unrolled`: the same matmuls (fused QKV, O, fused gate-up, down per layer, then the
  LM head) on T rows, one weight array per layer: the ideal the forward is measured against;
- `chain_scanned`: the same chain in a `lax.scan` over weights stacked `[L, ...]` (the
  layout the scanned model uses; XLA on CPU copies each layer's slice before its matmuls);
- `prefill`: the forward on T tokens of prefill (`--prefill-seqs` sequences), as GFLOP/s
  beside a large `[n, n] @ [n, n]` matmul in the same run.
Prints one JSON object.

    python benchmarks/step_breakdown.py --tokens 1 64 --context 1 --reps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_ms(fn, reps: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 2)


def step_inputs(arch, num_seqs: int, tokens_per_seq: int, context: int, block_size: int):
    from jaxllm.model import StepInputs

    blocks_per_seq = -(-context // block_size)
    t = num_seqs * tokens_per_seq
    positions = np.tile(np.arange(context - tokens_per_seq, context, dtype=np.int32), num_seqs)
    tables = 1 + np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
    seq = np.repeat(np.arange(num_seqs), tokens_per_seq)
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    inputs = StepInputs(
        token_ids=i32(np.arange(t) % arch.vocab_size),
        positions=i32(positions),
        slot_mapping=i32([slots]),  # one KV cache group
        cu_q_lens=i32(np.arange(num_seqs + 1) * tokens_per_seq),
        kv_lens=i32(np.full(num_seqs, context)),
        block_tables=i32([tables]),
        num_seqs=i32([num_seqs]),
        logits_indices=i32((np.arange(num_seqs) + 1) * tokens_per_seq - 1),
    )
    return inputs, 1 + num_seqs * blocks_per_seq


def chain_weights(arch, rng):
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    shapes = {
        "qkv": (h, (arch.num_heads + 2 * arch.num_kv_heads) * d),
        "o": (arch.num_heads * d, h),
        "gate_up": (h, 2 * i),
        "down": (i, h),
    }
    return [
        {k: jnp.asarray(0.02 * rng.standard_normal(s, np.float32)) for k, s in shapes.items()}
        for _ in range(arch.num_layers)
    ]


def chain_layer(x, w, q_width):
    x = x + (x @ w["qkv"])[:, :q_width] @ w["o"]
    gate_up = x @ w["gate_up"]
    half = gate_up.shape[1] // 2
    return x + (jax.nn.silu(gate_up[:, :half]) * gate_up[:, half:]) @ w["down"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model or config.json (default: the default model)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64], help="decode batch sizes T")
    ap.add_argument("--context", type=int, default=1)
    ap.add_argument("--prefill-seqs", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()

    from jaxllm.engine.args import EngineArgs
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.runner.cpu_kernels import step_model
    from jaxllm.runner.kv_cache import allocate_kv_cache
    from jaxllm.weights import load_model
    from jaxllm.weights.params import unstack_layers

    # float weights: this breaks down the float32 step (the quantized one: benchmarks/quantized_matmul.py)
    loaded = load_model(args.model, mesh=make_mesh(), load_format="dummy", dtype="float32", quantization="none")
    arch, block_size = loaded.arch, 16
    # the model the engine's step runs (backends, packed weights), not a default CausalLM
    config = EngineArgs(scan_layers=args.scan_layers).create_engine_config(
        arch.max_position_embeddings, jax.default_backend()
    )
    model = step_model(arch, config, jnp.float32, make_mesh())
    params = model.pack(loaded.params) if model.matmul_backend == "cpu_packed" else loaded.params
    params = params if args.scan_layers else unstack_layers(params, arch.num_layers)
    forward = jax.jit(lambda p, cache, inputs: model.apply({"params": p}, cache, inputs)[0])

    per_layer = chain_weights(arch, np.random.default_rng(0))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
    q_width, head = arch.num_heads * arch.head_dim, params["embed_tokens"]["embedding"]
    unrolled = jax.jit(lambda x, ws: [x := chain_layer(x, w, q_width) for w in ws][-1] @ head.T)
    scanned = jax.jit(lambda x, ws: jax.lax.scan(lambda x, w: (chain_layer(x, w, q_width), None), x, ws)[0] @ head.T)

    report = {
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "scan_layers": args.scan_layers,
        "matmul_backend": model.matmul_backend,
        "decode": {},
    }
    for t in args.tokens:
        inputs, num_blocks = step_inputs(arch, t, 1, args.context, block_size)
        cache = allocate_kv_cache(arch, num_blocks + 1, block_size, jnp.float32, make_mesh())
        x = jnp.ones((t, arch.hidden_size), jnp.float32)
        row = {
            "forward_ms": median_ms(lambda cache=cache, inputs=inputs: forward(params, cache, inputs), args.reps),
            "chain_unrolled_ms": median_ms(lambda x=x: unrolled(x, per_layer), args.reps),
            "chain_scanned_ms": median_ms(lambda x=x: scanned(x, stacked), args.reps),
        }
        row["forward_over_chain"] = round(row["forward_ms"] / row["chain_unrolled_ms"], 2)
        report["decode"][f"T={t}"] = row

    s, n = args.prefill_seqs, args.prefill_len
    inputs, num_blocks = step_inputs(arch, s, n, n, block_size)
    cache = allocate_kv_cache(arch, num_blocks + 1, block_size, jnp.float32, make_mesh())
    ms = median_ms(lambda: forward(params, cache, inputs), max(3, args.reps // 2))
    flops = 2 * s * n * sum(int(np.prod(w.shape)) for w in jax.tree.leaves(per_layer))
    flops += 2 * s * arch.vocab_size * arch.hidden_size  # the LM head runs on the last row of each sequence
    big = jnp.ones((2048, 2048), jnp.float32)
    matmul_ms = median_ms(lambda: jax.jit(jnp.matmul)(big, big), args.reps)
    report["prefill"] = {
        "tokens": s * n,
        "forward_ms": ms,
        "gflops": round(flops / ms / 1e6, 1),
        "large_matmul_gflops": round(2 * 2048**3 / matmul_ms / 1e6, 1),
    }
    report["prefill"]["share_of_large_matmul"] = round(
        report["prefill"]["gflops"] / report["prefill"]["large_matmul_gflops"], 2
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
