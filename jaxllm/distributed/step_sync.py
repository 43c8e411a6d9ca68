"""Leader → follower step broadcast: one SPMD program driven by node 0's scheduler.

Every compiled step runs on all nodes at once (its collectives span the global mesh), so every
node must launch the same bucket with the same inputs in the same order. Node 0 schedules; before
each step it broadcasts a fixed-size header (kind, bucket index, step number) and then the
bucket's padded inputs packed into one int32 buffer (the token history and
masks only when a row uses them), with `multihost_utils.broadcast_one_to_all`.
Followers only receive and run. When idle, the leader sends heartbeats so that a follower can
tell a quiet leader from a dead one; each side exits with a one-line error when the other goes
silent past the timeout, instead of hanging in a collective.

With pipeline stages on several nodes (runner/pipeline_hosts.py) the same broadcast drives each node's own
stages; their arrays cross by jax.experimental.transfer, and node 0 collects the sampled ids when the engine
applies the step.

This module sits below the engine core (as the runner does): it is handed a `ModelRunner` and
never imports the core; a follower's engine is built above it (`entrypoints/cli/common.run_headless`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

import jax
import numpy as np
from jax.experimental.multihost_utils import broadcast_one_to_all

from jaxllm.distributed.watchdog import Watchdog, die
from jaxllm.runner.model_runner import ModelRunner, RunnerOutput
from jaxllm.runner.pipeline_hosts import HostsPipelineRunner
from jaxllm.runner.sampler import SamplerOutput
from jaxllm.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

STOP, STEP, HEARTBEAT = 0, 1, 2
HEADER_SIZE = 4  # kind, bucket index, step, full payload (1) or light (0)


HEAVY = ("history", "allowed")  # sampling rows that stay at their defaults unless penalties or masks are used


class Payloads:
    """Packs a bucket's (StepInputs, SamplingInputs) into one int32 vector and back (every leaf is 4-byte).

    `history` ([S, max_model_len]) and `allowed` ([S, vocab/32]) are 90% of a step's bytes and
    hold only their defaults unless some row uses penalties or a token mask, so a "light" payload
    leaves them out and followers put the defaults back. Each bucket has a full and a light layout.
    """

    def __init__(self, runner: ModelRunner):
        self.layouts = []  # per bucket: {full: (treedef, [(shape, dtype)])}
        self.defaults = []  # per bucket: the heavy leaves at their defaults
        for bucket in runner.buckets:
            inputs, sampling = runner.batch.fill(SchedulerOutput(step=-1), bucket)
            heavy = {name: np.array(getattr(sampling, name)) for name in HEAVY}
            # None: the heavy leaves left out of the pytree (the light layout), not arrays
            light = sampling._replace(**{name: None for name in HEAVY})  # type: ignore[arg-type]
            self.layouts.append({full: self._layout((inputs, sampling if full else light)) for full in (True, False)})
            self.defaults.append(heavy)

    @staticmethod
    def _layout(tree):
        leaves, treedef = jax.tree.flatten(tree)
        assert all(a.dtype.itemsize == 4 for a in leaves), "step inputs must all be 4-byte arrays"
        return treedef, [(a.shape, a.dtype) for a in leaves]

    def size(self, index: int, full: bool) -> int:
        return sum(int(np.prod(shape)) for shape, _ in self.layouts[index][full][1])

    def pack(self, inputs, sampling) -> tuple[bool, np.ndarray]:
        full = bool(np.any(sampling.history != -1) or np.any(sampling.allowed != np.uint32(0xFFFFFFFF)))
        tree = (inputs, sampling if full else sampling._replace(**{name: None for name in HEAVY}))
        return full, np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.int32) for a in jax.tree.leaves(tree)])

    def unpack(self, index: int, full: bool, buffer: np.ndarray):
        treedef, layout = self.layouts[index][full]
        leaves, offset = [], 0
        for shape, dtype in layout:
            n = int(np.prod(shape))
            leaves.append(buffer[offset : offset + n].view(dtype).reshape(shape))
            offset += n
        inputs, sampling = jax.tree.unflatten(treedef, leaves)
        return inputs, sampling if full else sampling._replace(**self.defaults[index])

    def warm_up(self) -> None:
        """Compile the broadcast for the header and every payload shape now (all nodes, same order)."""
        broadcast_one_to_all(np.zeros(HEADER_SIZE, np.int32))
        for index in range(len(self.layouts)):
            for full in (True, False):
                broadcast_one_to_all(np.zeros(self.size(index, full), np.int32))


class StepLeader:
    """Node 0's side: `execute(out)` broadcasts the step, then runs it like a single-node runner would."""

    def __init__(self, runner: ModelRunner, timeout: float):
        self.runner = runner
        self.timeout = timeout
        self.payloads = Payloads(runner)
        self.payloads.warm_up()
        self.index = {bucket: i for i, bucket in enumerate(runner.buckets)}
        self.num_steps = 0
        self.broadcast_bytes = 0
        self.broadcast_seconds = 0.0
        self._lock = threading.Lock()  # one message at a time, in order: heartbeats never split a step
        self._last_sent = time.monotonic()
        self._closed = False
        self._watchdog = Watchdog(timeout, "jaxllm-leader-watchdog")
        threading.Thread(target=self._heartbeats, name="jaxllm-heartbeat", daemon=True).start()
        atexit.register(self.close)
        logger.info("node 0: driving %d follower node(s)", jax.process_count() - 1)

    def execute(self, out: SchedulerOutput, grammar=None) -> RunnerOutput | SamplerOutput:
        """Tensor parallelism: the step's results on the host. Pipeline stages on several nodes: node 0's stages run
        first (while the followers may still run the step before: a follower takes the broadcast only once that is
        done), and the sampled ids come back on the device, for the engine to `collect` when it applies the step."""
        bucket, inputs, sampling = self.runner.prepare(out, grammar)
        staged = isinstance(self.runner, HostsPipelineRunner)
        with self._lock:
            self._watchdog.arm(
                f"node 0: step {out.step} got no answer from the followers within "
                f"{self.timeout:.0f}s (a follower died or hangs)"
            )
            try:
                result = self.runner.run(bucket, inputs, sampling) if staged else None
                started = time.perf_counter()
                full, payload = self.payloads.pack(inputs, sampling)
                self._send(STEP, self.index[bucket], out.step, full)
                broadcast_one_to_all(payload)
                self.broadcast_seconds += time.perf_counter() - started
                self.broadcast_bytes += payload.nbytes + HEADER_SIZE * 4
                self.num_steps += 1
                if result is not None:
                    return result
                return self.runner.to_host(self.runner.run(bucket, inputs, sampling), out.num_rows)
            except Exception as e:  # a collective failed: the global mesh is gone for good
                die(
                    f"node 0: step {out.step} failed across the nodes, a follower is likely gone "
                    f"({str(e).strip().splitlines()[0][:200]})"
                )
            finally:
                self._watchdog.disarm()

    def close(self) -> None:
        """Tell the followers to exit (once)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._watchdog.arm(f"node 0: the followers did not take the stop message within {self.timeout:.0f}s")
            self._send(STOP)
            self._watchdog.disarm()

    def _send(self, kind: int, index: int = 0, step: int = 0, full: bool = False) -> None:
        broadcast_one_to_all(np.array([kind, index, step, full], np.int32))
        self._last_sent = time.monotonic()

    def _heartbeats(self) -> None:
        interval = self.timeout / 4
        while True:
            time.sleep(max(self._last_sent + interval - time.monotonic(), 0.05))
            with self._lock:
                if self._closed:
                    return
                if time.monotonic() - self._last_sent >= interval:
                    self._watchdog.arm(
                        f"node 0: a heartbeat got no answer within {self.timeout:.0f}s (a follower died or hangs)"
                    )
                    self._send(HEARTBEAT)
                    self._watchdog.disarm()


def follow(runner: ModelRunner, timeout: float) -> int:
    """A follower's whole life: run every step node 0 broadcasts until it says stop. Returns the steps run."""
    payloads = Payloads(runner)
    payloads.warm_up()
    rank = jax.process_index()
    watchdog = Watchdog(timeout, "jaxllm-follower-watchdog")
    logger.info("node %d: following node 0's steps", rank)
    try:
        return _follow_loop(runner, payloads, watchdog, rank, timeout)
    except Exception as e:  # a collective failed: the leader is gone
        die(f"node {rank}: lost the leader (node 0): {str(e).strip().splitlines()[0][:200]}")


def _follow_loop(runner: ModelRunner, payloads: Payloads, watchdog: Watchdog, rank: int, timeout: float) -> int:
    steps = 0
    while True:
        watchdog.arm(f"node {rank}: the leader (node 0) sent nothing for {timeout:.0f}s; it died or hangs")
        kind, index, step, full = (int(x) for x in broadcast_one_to_all(np.zeros(HEADER_SIZE, np.int32)))
        if kind == STOP:
            watchdog.disarm()
            logger.info("node %d: leader said stop after %d steps", rank, steps)
            return steps
        if kind == HEARTBEAT:
            continue
        buffer = broadcast_one_to_all(np.zeros(payloads.size(index, bool(full)), np.int32))
        inputs, sampling = payloads.unpack(index, bool(full), buffer)
        # wait for the step: XLA may run independent programs concurrently, and the next broadcast's
        # collective must not interleave with this step's own (gloo would pair the wrong messages)
        jax.block_until_ready(runner.run(runner.buckets[index], inputs, sampling))
        steps += 1
