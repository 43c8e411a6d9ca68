"""Joining a multi-host run: `jax.distributed.initialize` under vLLM's flag names.

Every node runs the same command with its own `--node-rank`; node 0 hosts JAX's coordinator
at `--master-addr:--master-port`. Afterwards `jax.devices()` lists every node's devices, so the
ordinary mesh (`parallel/mesh.py`) spans all of them. On CPU the cross-process collectives are
gloo and each node contributes `pipeline_parallel_size * tensor_parallel_size // nnodes` host devices.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import time

import jax
import numpy as np

from jaxllm.distributed.watchdog import Watchdog

logger = logging.getLogger(__name__)


def check_node_args(
    nnodes: int,
    node_rank: int,
    master_port: int,
    tensor_parallel_size: int,
    data_parallel_size: int,
    pipeline_parallel_size: int = 1,
) -> None:
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be a positive integer, got {nnodes!r}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={nnodes}), got {node_rank!r}")
    if not 0 < master_port < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {master_port!r}")
    if nnodes > 1 and pipeline_parallel_size > 1:
        if pipeline_parallel_size % nnodes:
            raise ValueError(
                f"pipeline_parallel_size={pipeline_parallel_size} must be a multiple of nnodes={nnodes}: "
                "each node holds the same number of whole stages"
            )
    elif nnodes > 1 and tensor_parallel_size % nnodes:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must be a multiple of nnodes={nnodes}: "
            "each node holds the same number of the model's shards"
        )
    if nnodes > 1 and data_parallel_size > 1:
        raise ValueError(
            "data_parallel_size > 1 with nnodes > 1 is not supported: run one multi-node "
            "engine per replica behind a router (see docs/scaling.md)"
        )


def initialize(
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    *,
    tensor_parallel_size: int,
    timeout: float,
    pipeline_parallel_size: int = 1,
) -> None:
    """Join the run (no-op for one node). A node that cannot reach the others within `timeout` exits with one line."""
    if nnodes == 1 or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # the CPU backend only: each node's share of the devices (whole pipeline stages, or tensor-parallel shards)
    jax.config.update("jax_num_cpu_devices", pipeline_parallel_size * tensor_parallel_size // nnodes)
    address = f"{master_addr}:{master_port}"
    who = "the leader" if node_rank else f"{nnodes - 1} follower(s)"
    watchdog = Watchdog(timeout + 5)  # JAX's own timeout first; this catches a hang inside it
    watchdog.arm(f"node {node_rank}: could not reach {who} at {address} within {timeout:.0f}s")
    started = time.perf_counter()
    native_stdout_to_stderr()
    try:
        _join(nnodes, node_rank, address, timeout, started)
    except Exception as e:  # JAX's message is pages long; keep its first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConnectionError(
            f"node {node_rank}: could not join {nnodes} nodes at {address} within {timeout:.0f}s ({first[:200]})"
        ) from None
    finally:
        watchdog.disarm()


def _join(nnodes: int, node_rank: int, address: str, timeout: float, started: float) -> None:
    """`jax.distributed.initialize`, then gloo's connections made at a collective every node waits for."""
    jax.distributed.initialize(
        address,
        nnodes,
        node_rank,
        initialization_timeout=max(int(timeout), 1),
        heartbeat_timeout_seconds=max(int(timeout), 10),
    )
    # the first collective sets up gloo's connections, which gives up after 30 s: line the nodes up at a
    # barrier with our own timeout first, then do it, rather than during loading where one may lag
    logger.info("node %d: connected to %s in %.1fs", node_rank, address, time.perf_counter() - started)
    _global_min()  # compiled before the barrier, so that nothing slow sits between it and the collective
    logger.info(
        "node %d: %d devices, first program ready at %.1fs",
        node_rank,
        len(jax.devices()),
        time.perf_counter() - started,
    )
    _barrier("jaxllm-joined", timeout)
    # gloo connects here, at the first collective over every device in `jax.devices()` order; the engine's
    # TP mesh and the step broadcasts use the same devices in the same order, so they connect no more
    agree_min(0)
    logger.info("node %d: joined %d nodes in %.1fs", node_rank, nnodes, time.perf_counter() - started)


_native_stdout_switched = False


def native_stdout_to_stderr() -> None:
    """From now on, what C/C++ libraries write to file descriptor 1 goes to stderr; Python's `sys.stdout` keeps the
    real stdout, for the generated text only.

    gloo prints "[Gloo] Rank r is connected to n peer ranks. ..." to stdout at the first collective over each new
    set of devices: when the nodes join, and again at the first step that runs a collective over a sub-mesh (a
    pipeline stage's tensor-parallel group on its node), long after start-up. Once per process.
    """
    global _native_stdout_switched
    if _native_stdout_switched:
        return
    _native_stdout_switched = True
    sys.stdout.flush()
    _libc_fflush()  # C stdio's buffered output, written before the switch, still goes to stdout
    real = os.dup(1)
    os.dup2(2, 1)
    out = sys.stdout
    sys.stdout = open(real, "w", encoding=out.encoding, errors=out.errors, buffering=1)  # noqa: SIM115 - for good


def _libc_fflush() -> None:
    """Flush C stdio's buffers (std::cout's too, synced with stdio)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no libc to load here: nothing buffered in it either
        pass


def _barrier(name: str, timeout: float) -> None:
    """Wait until every node gets here (JAX's coordination-service barrier, no collective involved)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    client.wait_at_barrier(name, int(timeout * 1000))


def agree_min(value: int) -> int:
    """The smallest `value` over all nodes: what fixes a compiled shape (the KV block count) must match everywhere."""
    if jax.process_count() == 1:
        return value
    sharding, compiled = _global_min()
    local = np.full(jax.local_device_count(), value, np.int32)
    return int(compiled(jax.make_array_from_process_local_data(sharding, local)))


@functools.cache
def _global_min():
    """A compiled min over one int32 per device of every node."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("nodes",))
    sharding = NamedSharding(mesh, PartitionSpec("nodes"))
    spec = jax.ShapeDtypeStruct((len(jax.devices()),), np.int32, sharding=sharding)
    compiled = jax.jit(jnp.min, out_shardings=NamedSharding(mesh, PartitionSpec())).lower(spec).compile()
    return sharding, compiled


def initialize_from_args(args) -> None:
    """`initialize` from `EngineArgs` (validated first)."""
    check_node_args(
        args.nnodes,
        args.node_rank,
        args.master_port,
        args.tensor_parallel_size,
        args.data_parallel_size,
        args.pipeline_parallel_size,
    )
    initialize(
        args.nnodes,
        args.node_rank,
        args.master_addr,
        args.master_port,
        tensor_parallel_size=args.tensor_parallel_size,
        timeout=args.distributed_timeout,
        pipeline_parallel_size=args.pipeline_parallel_size,
    )
