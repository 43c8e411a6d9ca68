"""Data parallelism: N engine-core processes behind one front, each replica on its own devices.

`DataParallelClient` implements the engine-core client interface (`engine/core_client.py`), so
`AsyncLLM` and the HTTP server work unchanged. Each replica is a spawned process running an
`EngineCore` (its own tensor-parallel mesh: `CUDA_VISIBLE_DEVICES` slice on GPU,
`jax_num_cpu_devices` on CPU) and talks to the front over one `multiprocessing` pipe.

Routing is vLLM's: each request goes to the replica with the lowest `4 * waiting + running`,
with KV-cache usage breaking ties and a rotating start so equal replicas take turns. Replicas
push those counts after their steps (at most every ~100 ms); between pushes the front counts
what it routed itself, so a burst spreads before the next push. A replica that dies fails only
its own in-flight requests; the others keep serving.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.block_hash import prefix_hashes
from jaxllm.engine.core_client import DeadHandler, EngineInfo, OutputHandler, apply_command, failed_output
from jaxllm.kv_events.index import InstanceView, PrefixIndex
from jaxllm.kv_events.publisher import InProcessSink
from jaxllm.kv_events.subscriber import EventSequencer
from jaxllm.routing.base import RoutingPolicy
from jaxllm.routing.registry import load_policy
from jaxllm.routing.view import ClusterView, InstanceState, RouteRequest

logger = logging.getLogger("jaxllm")

STATS_INTERVAL_S = 0.1
READY_TIMEOUT_S = 1800.0  # loading and compiling on a busy CPU can take many minutes


def replica_devices(index: int, tensor_parallel_size: int) -> dict[str, str]:
    """Environment that gives replica `index` its own devices: a GPU slice when there are GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None and shutil.which("nvidia-smi"):
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        visible = ",".join(str(i) for i in range(listing.count("GPU ")))
    if not visible:
        return {}
    gpus = visible.split(",")
    mine = gpus[index * tensor_parallel_size : (index + 1) * tensor_parallel_size]
    if len(mine) < tensor_parallel_size:
        raise ValueError(
            f"data_parallel_size x tensor_parallel_size needs {(index + 1) * tensor_parallel_size} "
            f"GPUs, only {len(gpus)} visible"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


def _replica_main(index: int, args: EngineArgs, env: dict[str, str], conn, progress: bool) -> None:
    """One replica's process: an EngineCore stepping whatever the front sends, outputs back each step."""
    os.environ.update(env)
    os.environ.pop("XLA_FLAGS", None)  # a forced host-device count would override jax_num_cpu_devices
    import jax

    jax.config.update("jax_num_cpu_devices", args.tensor_parallel_size)  # CPU only; GPUs come from env
    from jaxllm.engine.core import EngineCore

    try:
        core = EngineCore(args, progress=progress)
    except Exception as e:  # noqa: BLE001 - the front reports it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", EngineInfo.of(core), core.stats()))
    # KV events (in-process) go to the front with each step's outputs, for a policy that reads them
    sink = core.kv_events.sink if core.kv_events is not None else None
    events = sink.reader() if isinstance(sink, InProcessSink) else None
    last_push = 0.0
    while True:
        outputs = []
        idle = not core.has_unfinished_requests()
        while conn.poll(None if idle else 0):  # idle: block for the next command, spending no CPU
            idle = False
            try:
                kind, payload = conn.recv()
            except EOFError:  # the front is gone
                return
            if kind == "stop":
                return
            outputs += apply_command(core, kind, payload)
        if core.has_unfinished_requests():
            outputs += core.step()
        now = time.monotonic()
        stats = None
        if now - last_push >= STATS_INTERVAL_S or not core.has_unfinished_requests():
            stats, last_push = core.stats(), now
        batches = events.poll() if events is not None else []
        if outputs or stats is not None or batches:
            conn.send(("step", outputs, now, stats, batches))


@dataclasses.dataclass
class _Replica:
    index: int
    process: BaseProcess
    conn: Connection
    stats: dict
    in_flight: dict[str, tuple] = dataclasses.field(default_factory=dict)  # id → (prompt ids, params)
    routed_since_push: int = 0  # requests sent after the last pushed counts
    alive: bool = True
    send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    events: EventSequencer | None = None  # its KV events into the front's prefix index


class DataParallelClient:
    def __init__(self, args: EngineArgs, on_outputs: OutputHandler, on_dead: DeadHandler, *, progress: bool = True):
        n = args.data_parallel_size
        if n < 2:
            raise ValueError(f"DataParallelClient needs data_parallel_size >= 2, got {n}")
        if args.nnodes > 1:
            raise ValueError("data_parallel_size > 1 with nnodes > 1 is not supported")
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}  # request id → replica
        self._next_start = 0
        # a router policy (jaxllm/routing/) over the replicas, fed their loads and KV events; None: vLLM's rule
        self.policy: RoutingPolicy | None = None
        self.index = PrefixIndex()
        replica_args = dataclasses.replace(args, data_parallel_size=1, data_parallel_policy=None)
        if args.data_parallel_policy is not None:
            self.policy = load_policy(args.data_parallel_policy)
            if self.policy.needs_block_hashes and args.kv_events_config is None:
                events = {"enable_kv_cache_events": True, "publisher": "null"}
                replica_args = dataclasses.replace(replica_args, kv_events_config=events)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: JAX must not be forked
        self.replicas: list[_Replica] = []
        for i in range(n):
            ours, theirs = ctx.Pipe()
            env = replica_devices(i, args.tensor_parallel_size)
            process = ctx.Process(
                target=_replica_main,
                args=(i, replica_args, env, theirs, progress and i == 0),
                name=f"jaxllm-engine-{i}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.replicas.append(_Replica(i, process, ours, {}))
        try:
            self.info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        for replica in self.replicas:
            replica.events = EventSequencer(
                InstanceView(self.index, str(replica.index)), name=f"replica {replica.index}"
            )
            threading.Thread(
                target=self._read, args=(replica,), name=f"jaxllm-dp-reader-{replica.index}", daemon=True
            ).start()
        atexit.register(self.shutdown)  # before multiprocessing terminates its daemons, so no "replica died"

    def _wait_ready(self) -> EngineInfo:
        info: EngineInfo | None = None
        for replica in self.replicas:
            if not replica.conn.poll(READY_TIMEOUT_S):
                raise RuntimeError(f"engine replica {replica.index} did not start within {READY_TIMEOUT_S:.0f}s")
            try:
                message = replica.conn.recv()
            except EOFError:
                raise RuntimeError(
                    f"engine replica {replica.index} exited while starting (status {replica.process.exitcode})"
                ) from None
            if message[0] == "failed":
                raise ValueError(f"engine replica {replica.index}: {message[1]}")
            _, info, replica.stats = message
        logger.info("%d data-parallel engine replicas ready", len(self.replicas))
        assert info is not None  # there are replicas (at least 2)
        return info

    # ---- the interface -------------------------------------------------------------------

    def add_request(
        self, request_id, prompt_token_ids, params, *, prompt=None, priority=0, arrival_time=None, user=None
    ):
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        with self._lock:
            replica = self._least_loaded() if self.policy is None else self._by_policy(prompt_token_ids, user)
            if replica is None:
                self._on_outputs(
                    [failed_output(request_id, prompt_token_ids, params, prompt, "every engine replica has died")],
                    0,
                    time.monotonic(),
                    None,
                )
                return
            replica.in_flight[request_id] = (prompt_token_ids, params)
            replica.routed_since_push += 1
            self._owner[request_id] = replica.index
        self._send(replica, ("add", (request_id, prompt_token_ids, params, prompt, priority, arrival_time, user)))

    def abort(self, request_ids: Iterable[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                if (index := self._owner.get(rid)) is not None:
                    by_replica.setdefault(index, []).append(rid)
        for index, ids in by_replica.items():
            self._send(self.replicas[index], ("abort", ids))

    def reset_prefix_cache(self) -> None:
        """Every live replica forgets its cached prefixes before it takes the next request (pipes keep order)."""
        for replica in self.replicas:
            if replica.alive:
                self._send(replica, ("reset_prefix_cache", None))

    def stats(self) -> list[dict]:
        return [r.stats for r in self.replicas]

    def is_alive(self) -> bool:
        return any(r.alive for r in self.replicas)

    def dead_replicas(self) -> list[int]:
        return [r.index for r in self.replicas if not r.alive]

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.alive = False
            try:
                with replica.send_lock:
                    replica.conn.send(("stop", None))
            except (OSError, ValueError):
                pass
        for replica in self.replicas:
            replica.process.join(timeout=10)
            if replica.process.is_alive():
                replica.process.terminate()

    # ---- routing -------------------------------------------------------------------------

    def _least_loaded(self) -> _Replica | None:
        """vLLM's rule: lowest 4 * waiting + running, then lowest KV usage; the start rotates."""
        n = len(self.replicas)
        order = [self.replicas[(self._next_start + k) % n] for k in range(n)]
        self._next_start = (self._next_start + 1) % n
        alive = [r for r in order if r.alive]
        if not alive:
            return None

        def load(r: _Replica):
            waiting = r.stats.get("num_waiting", 0) + r.routed_since_push
            return 4 * waiting + r.stats.get("num_running", 0), r.stats.get("kv_cache_usage", 0.0)

        return min(alive, key=load)  # min keeps the first of equals: the rotating start

    def _by_policy(self, prompt_token_ids: list[int], user: str | None) -> _Replica | None:
        """The router policy's choice among the live replicas (their loads as last pushed, plus those sent since)."""
        assert self.policy is not None
        alive = [r for r in self.replicas if r.alive]
        if not alive:
            return None
        states = [
            InstanceState(
                str(r.index),
                running=r.stats.get("num_running", 0),
                waiting=r.stats.get("num_waiting", 0),
                dispatched=r.routed_since_push,
            )
            for r in alive
        ]
        hashes: list[bytes] = []
        if self.policy.needs_block_hashes:
            hashes = prefix_hashes(prompt_token_ids, self.info.block_size, bytes.fromhex(self.info.kv_scope_root))
        request = RouteRequest(hashes, self.info.kv_scope_root, session=user)
        chosen = self.policy.choose(request, ClusterView(states, self.index))
        return alive[states.index(chosen)]

    # ---- replies -------------------------------------------------------------------------

    def _send(self, replica: _Replica, message) -> None:
        try:
            with replica.send_lock:
                replica.conn.send(message)
        except (OSError, ValueError):  # its reader thread notices the death and fails its requests
            pass

    def _read(self, replica: _Replica) -> None:
        while True:
            try:
                _, outputs, timestamp, stats, batches = replica.conn.recv()
            except (EOFError, OSError):
                return self._lost(replica)
            for batch in batches:
                assert replica.events is not None
                replica.events.receive(batch)
            with self._lock:
                if stats is not None:
                    replica.stats, replica.routed_since_push = stats, 0
                for out in outputs:
                    if out.finished:
                        replica.in_flight.pop(out.request_id, None)
                        self._owner.pop(out.request_id, None)
            if outputs or stats is not None:
                self._on_outputs(outputs, replica.index, timestamp, stats)

    def _lost(self, replica: _Replica) -> None:
        if not replica.alive:  # shut down on purpose
            return
        replica.process.join(timeout=5)
        message = f"engine replica {replica.index} died (exit status {replica.process.exitcode})"
        self.index.forget(str(replica.index))
        with self._lock:
            replica.alive = False
            lost = dict(replica.in_flight)
            replica.in_flight.clear()
            for rid in lost:
                self._owner.pop(rid, None)
            replica.stats = stats = {**replica.stats, "num_running": 0, "num_waiting": 0}
        logger.error(
            "%s; failing its %d in-flight request(s)%s",
            message,
            len(lost),
            "" if self.is_alive() else "; no replica is left",
        )
        # the failed requests and the emptied replica reach the front's counters and gauges together
        self._on_outputs(
            [failed_output(rid, ids, params, None, message) for rid, (ids, params) in lost.items()],
            replica.index,
            time.monotonic(),
            stats,
        )
        if not self.is_alive():
            self._on_dead("every engine replica has died")


class DataParallelEngine:
    """The part of `EngineCore` that `LLM` drives, over data-parallel replicas: `LLM(data_parallel_size=N)`."""

    def __init__(self, args: EngineArgs, *, progress: bool = True):
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self.client = DataParallelClient(
            args,
            lambda outputs, *_: self._outputs.put(outputs),
            lambda message: self._outputs.put(RuntimeError(message)),
            progress=progress,
        )
        self.tokenizer = self.client.info.tokenizer

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        self.client.info.validate_prompt(prompt_token_ids)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params=None,
        *,
        prompt=None,
        priority=0,
        arrival_time=None,
        user=None,
    ) -> None:
        from jaxllm.sampling_params import SamplingParams

        self.client.add_request(
            request_id,
            prompt_token_ids,
            params if params is not None else SamplingParams(),
            prompt=prompt,
            priority=priority,
            arrival_time=arrival_time,
            user=user,
        )

    def step(self) -> list:
        """The outputs of the next step any replica finished (waits for one), and any others already in."""
        batches = [self._outputs.get()]
        while not self._outputs.empty():
            batches.append(self._outputs.get())
        if errors := [b for b in batches if isinstance(b, Exception)]:
            raise errors[0]
        return [out for batch in batches for out in batch]

    def abort_request(self, request_id: str) -> None:
        self.client.abort([request_id])

    def reset_prefix_cache(self) -> bool:
        if any(r.in_flight for r in self.client.replicas):
            return False
        self.client.reset_prefix_cache()
        return True

    def shutdown(self) -> None:
        self.client.shutdown()
