"""Copying whole KV blocks out of and into the donated cache: what KV connectors move (kv_transfer/).

`gather(block_ids)` returns the blocks' K and V, each `[slots, n, block_size, kv_heads, head_dim]` (a block id is
one KV cache group's: its slots are that group's layers) and sharded over KV heads as the cache is (with tensor
parallelism each device moves its own heads); `scatter(block_ids, k, v)` writes them into the cache, which it
donates and replaces, so neither copies the cache. Both are compiled ahead of time for power-of-two block counts up
to the most blocks a request holds over its groups (`ModelRunner.max_blocks_per_request`; `warm_up`, beside the model's
steps): a count in between is padded with the scratch block 0, whose contents nobody reads; a larger one goes in
chunks. They are dispatched in order with the steps, so a gather sees every step launched before it and a scatter
lands before any step launched after it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kv_cache_groups import SCRATCH_BLOCK
from jaxllm.model import KVCache
from jaxllm.parallel.mesh import kv_cache_sharding, replicated


def block_count_buckets(max_blocks: int) -> list[int]:
    sizes = [1]
    while sizes[-1] < max_blocks:
        sizes.append(sizes[-1] * 2)
    return sizes


class KVBlockMover:
    """Moves blocks of `runner`'s cache (a ModelRunner: `cache`, `mesh`), up to `max_blocks` at once (more go in
    chunks): the most a request holds over its groups."""

    def __init__(self, runner, max_blocks: int):
        self.runner = runner
        self.buckets = block_count_buckets(max_blocks)
        self.sharding = kv_cache_sharding(runner.mesh)
        ids = replicated(runner.mesh)
        self._gather_fn = jax.jit(_gather, out_shardings=(self.sharding, self.sharding))
        self._scatter_fn = jax.jit(
            _scatter, donate_argnums=(0,), in_shardings=(self.sharding, ids, self.sharding, self.sharding)
        )
        self._gathers: dict[int, jax.stages.Compiled] = {}
        self._scatters: dict[int, jax.stages.Compiled] = {}
        self.compile_seconds = 0.0

    # ---- shapes ------------------------------------------------------------------------------

    def block_shape(self, n: int) -> tuple[int, ...]:
        layers, _, block, heads, dim = self.runner.cache.k.shape
        return (layers, n, block, heads, dim)

    @property
    def dtype(self):
        return self.runner.cache.k.dtype

    def nbytes(self, n: int) -> int:
        """Bytes of K and V of `n` blocks (all devices together)."""
        return 2 * int(np.prod(self.block_shape(n))) * jnp.dtype(self.dtype).itemsize

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def spec(self, n: int) -> jax.ShapeDtypeStruct:
        """The shape, dtype and sharding of a gather of `n` blocks (`n` a bucket)."""
        return jax.ShapeDtypeStruct(self.block_shape(n), self.dtype, sharding=self.sharding)

    # ---- compile -----------------------------------------------------------------------------

    def warm_up(self) -> float:
        """Compile the gather and scatter of every bucket (nothing compiles while serving). Returns seconds."""
        started = time.perf_counter()
        cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.runner.cache)
        ids_sharding = replicated(self.runner.mesh)

        def compile_pair(n: int):
            ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=ids_sharding)
            spec = self.spec(n)
            gather = self._gather_fn.lower(cache, ids).compile()
            return n, gather, self._scatter_fn.lower(cache, ids, spec, spec).compile()

        with ThreadPoolExecutor(2) as pool:
            for n, gather, scatter in pool.map(compile_pair, self.buckets):
                self._gathers[n], self._scatters[n] = gather, scatter
        self.compile_seconds = time.perf_counter() - started
        return self.compile_seconds

    # ---- move --------------------------------------------------------------------------------

    def _chunks(self, block_ids: list[int]):
        largest = self.buckets[-1]
        for start in range(0, len(block_ids), largest):
            chunk = block_ids[start : start + largest]
            n = self.bucket(len(chunk))
            yield start, len(chunk), n, np.asarray(chunk + [SCRATCH_BLOCK] * (n - len(chunk)), np.int32)

    def gather_padded(self, block_ids: list[int]) -> tuple[jax.Array, jax.Array]:
        """The blocks' K and V on the device, padded to their bucket (at most the largest one)."""
        if len(block_ids) > self.buckets[-1]:
            raise ValueError(f"{len(block_ids)} blocks are more than a request's {self.buckets[-1]}")
        (_, _, n, ids), *_ = self._chunks(block_ids)
        return self._gathers[n](self.runner.cache, ids)

    def gather(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The blocks' K and V as host arrays `[num_layers, len(block_ids), ...]`."""
        ks, vs = [], []
        for _, count, n, ids in self._chunks(block_ids):
            k, v = self._gathers[n](self.runner.cache, ids)
            ks.append(np.asarray(k)[:, :count])
            vs.append(np.asarray(v)[:, :count])
        return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)

    def scatter(self, block_ids: list[int], k, v) -> None:
        """Write K and V (`[num_layers, >= len(block_ids), ...]`, host or device) into the blocks; a block id of
        0 (scratch) drops its block."""
        for start, count, n, ids in self._chunks(block_ids):
            kc, vc = k[:, start : start + count], v[:, start : start + count]
            if count < n or kc.shape[1] != n:
                pad = [(0, 0), (0, n - count)] + [(0, 0)] * 3
                kc, vc = np.pad(np.asarray(kc), pad), np.pad(np.asarray(vc), pad)
            kc = jax.device_put(kc, self.sharding)
            vc = jax.device_put(vc, self.sharding)
            self.runner.cache = self._scatters[n](self.runner.cache, ids, kc, vc)


def _gather(cache: KVCache, ids: jax.Array):
    return cache.k[:, ids], cache.v[:, ids]


def _scatter(cache: KVCache, ids: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    return KVCache(cache.k.at[:, ids].set(k.astype(cache.k.dtype)), cache.v.at[:, ids].set(v.astype(cache.v.dtype)))
