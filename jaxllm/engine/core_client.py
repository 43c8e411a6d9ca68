"""The engine-core client: how `AsyncLLM` reaches engine cores without ever stepping one itself.

`AsyncLLM` only uses the small interface below, so the cores can live on a background
thread (`InProcessClient`, here) or in other processes (a data-parallel client implements
the same methods). The rules every client keeps:

- `add_request` / `abort` never block and never touch a core directly: they queue a command
  that the core's own loop applies at the top of its next step, so a core is only ever
  driven by one thread.
- Outputs go to `on_outputs(outputs, engine_index, timestamp)`, called on the client's own
  thread once per step with that step's `RequestOutput`s (cumulative: each carries
  everything generated so far). A request that fails to be added comes back as a finished
  output with `error` set, so nothing waits forever.
- If a core dies, `on_dead(message)` is called once; the front fails what was in flight.
- `stats()` returns one snapshot dict per core (see `EngineCore.stats`), refreshed every
  step; reading it never waits for a step.
- LoRA adapters (optional: a client without these methods serves no adapters): `add_lora`,
  `remove_lora`, `list_loras` queue a call that the core's loop makes between steps, like any
  command, and return a `concurrent.futures.Future` of its result or its exception
  (ValueError, FileNotFoundError: the adapter's files), so the caller sees what the core said.
- When no request is unfinished, a core's loop blocks on its command queue: an idle
  server spends no CPU.

A client class is built as `Client(engine_args, on_outputs, on_dead, progress=...)`, returns
once every core is ready, and exposes `info` (an `EngineInfo`); `AsyncLLM(args, client_class=...)`
picks one.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from jaxllm.engine.args import EngineArgs
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.pooling.params import PoolingParams
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger("jaxllm")

# (outputs, engine index, timestamp, the core's stats after the step or None if unchanged): the stats ride with the
# outputs so that the front's gauges and counters change together (a scrape never sees the KV cache freed before
# the request that freed it is counted)
OutputHandler = Callable[[list[RequestOutput], int, float, dict | None], None]
DeadHandler = Callable[[str], None]


@dataclass(frozen=True)
class EngineInfo:
    """What the front needs to know about the engines it drives (the same for every core)."""

    model: str  # the model's name or path
    tokenizer: Any  # a transformers tokenizer, or None
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    reasoning_parser: str | None = None  # the syntax the engine reads thinking in (None: the model does not reason)
    runner: str = "generate"  # "pooling": embeddings and scores (jaxllm/pooling/)
    hidden_size: int = 0  # the embedding size (the pooling runner)
    pooler: Any = None  # the pooling runner's PoolerConfig, resolved against the model
    block_size: int = 16
    kv_scope_root: str = ""  # hex: the root every block hash chains from (kv_transfer/scope.py)
    kv_events: dict | None = None  # the KV events config (kv_events_config), None when off

    @classmethod
    def of(cls, core) -> EngineInfo:
        """What an EngineCore's front needs to know about it."""
        sched, arch = core.config.scheduler, core.loaded.arch
        return cls(
            core.loaded.name,
            core.tokenizer,
            sched.max_model_len,
            sched.max_num_seqs,
            arch.vocab_size,
            core.reasoning.name if core.reasoning is not None else None,
            core.config.runner,
            arch.hidden_size,
            core.config.pooler,
            block_size=core.config.cache.block_size,
            kv_scope_root=core.kv_scope.root.hex(),
            kv_events=kv_events_info(core),
        )

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        from jaxllm.engine.startup import check_prompt

        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)


class EngineCoreClient(Protocol):
    info: EngineInfo

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        user: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None: ...

    def abort(self, request_ids: Iterable[str]) -> None: ...

    def stats(self) -> list[dict]: ...

    def is_alive(self) -> bool: ...

    def shutdown(self) -> None: ...


def failed_output(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams | PoolingParams,
    prompt: str | None,
    error: str,
    *,
    refused: bool = False,
) -> RequestOutput:
    """The finished output of a request the engine failed or (`refused`) would not take: every sample ends with
    "error"."""
    n = getattr(params, "n", 1)  # (PoolingParams: one)
    samples = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error") for i in range(n)]
    return RequestOutput(request_id, prompt, prompt_token_ids, samples, finished=True, error=error, refused=refused)


def apply_command(core, kind: str, payload) -> list[RequestOutput]:
    """Apply one "add", "abort" or "reset_prefix_cache" command to an `EngineCore`; a refused request becomes a
    failed output. An "add" payload may end with a LoRARequest (an 8th item; data-parallel clients send 7)."""
    if kind == "abort":
        return [o for rid in payload if (o := core.abort_request(rid)) is not None]
    if kind == "reset_prefix_cache":
        core.reset_prefix_cache()
        return []
    request_id, ids, params, prompt, priority, arrival, user, *rest = payload
    lora = rest[0] if rest else None
    try:
        core.add_request(
            request_id,
            ids,
            params,
            prompt=prompt,
            priority=priority,
            arrival_time=arrival,
            user=user,
            lora_request=lora,
        )
    except (ValueError, OSError) as e:  # OSError: an adapter's files, read on its first request, are gone
        return [failed_output(request_id, ids, params, prompt, str(e), refused=True)]
    return []


class InProcessClient:
    """One `EngineCore` stepping on a daemon thread of this process.

    JAX releases the GIL while a compiled step runs, so the event loop serving HTTP keeps
    running during steps; the host work of a step (scheduling, detokenization) shares the
    GIL with it. docs/serving.md has the measurements behind choosing a thread.
    """

    def __init__(self, args: EngineArgs, on_outputs: OutputHandler, on_dead: DeadHandler, *, progress: bool = True):
        from jaxllm.engine.core import EngineCore

        self.core = EngineCore(args, progress=progress)
        self.info = EngineInfo.of(self.core)
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stats = [self.core.stats()]
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="jaxllm-engine-core", daemon=True)
        self._thread.start()

    # ---- the interface -------------------------------------------------------------------

    def add_request(
        self,
        request_id,
        prompt_token_ids,
        params,
        *,
        prompt=None,
        priority=0,
        arrival_time=None,
        user=None,
        lora_request=None,
    ):
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        payload = (request_id, prompt_token_ids, params, prompt, priority, arrival_time, user, lora_request)
        self._commands.put(("add", payload))

    def add_lora(self, lora_request: LoRARequest) -> Future:
        """Read and check an adapter on the engine thread (EngineCore.add_lora): a Future of True, or its error."""
        return self._call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> Future:
        return self._call("remove_lora", lora_int_id)

    def list_loras(self) -> Future:
        return self._call("list_loras")

    def _call(self, method: str, *args) -> Future:
        """`core.method(*args)` made by the engine thread between steps (the core is only ever driven by it)."""
        future: Future = Future()
        if not self.is_alive():
            future.set_exception(RuntimeError("the engine is not running"))
        else:
            self._commands.put(("call", (method, args, future)))
            if not self._thread.is_alive():  # the loop ended meanwhile, not seeing it
                self._fail_calls()
        return future

    def abort(self, request_ids: Iterable[str]) -> None:
        self._commands.put(("abort", list(request_ids)))

    def stats(self) -> list[dict]:
        return self._stats

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self) -> None:
        """Stop the loop after its current step; unfinished requests are dropped."""
        self._stopping = True
        self._commands.put(("stop", None))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                self.core.close_kv_events()  # its sockets freed (a new engine may bind them)

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                block = not self.core.has_unfinished_requests()
                outputs = self._apply_commands(block)
                if self.core.has_unfinished_requests() and not self._stopping:
                    outputs += self.core.step()
                stats = self.core.stats()
                changed = stats != self._stats[0]
                self._stats = [stats]
                if outputs or changed:
                    self._on_outputs(outputs, 0, time.monotonic(), stats)
        except Exception as e:  # a bug in the engine: say so once, the front fails what is in flight
            logger.exception("the engine core loop died")
            self._stopping = True
            self._on_dead(f"the engine died: {type(e).__name__}: {e}")
        finally:  # calls nobody will make any more: their callers must not wait forever
            self._fail_calls()

    def _fail_calls(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get(block=False)
            except queue.Empty:
                return
            if kind == "call" and payload[2].set_running_or_notify_cancel():
                payload[2].set_exception(RuntimeError("the engine is not running"))

    def _apply_commands(self, block: bool) -> list[RequestOutput]:
        """Apply every queued command; wait for the first one if `block` (the engine is idle)."""
        outputs: list[RequestOutput] = []
        while True:
            try:
                kind, payload = self._commands.get(block=block)
            except queue.Empty:
                return outputs
            block = False
            if kind == "stop":
                return outputs
            if kind == "call":
                call(self.core, *payload)
                continue
            outputs += apply_command(self.core, kind, payload)


def call(core, method: str, args: tuple, future: Future) -> None:
    """Make `core.method(*args)` (on the engine thread), its result or exception into `future`."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = getattr(core, method)(*args)
    except Exception as e:  # ValueError, FileNotFoundError...: the caller's to report
        future.set_exception(e)
    else:
        future.set_result(result)


def kv_events_info(core) -> dict | None:
    """The KV events config as a router reads it (None when off), with the addresses the publisher bound (a port
    given as `*` is a real one here)."""
    config = core.kv_events_config
    if config is None or not config.enable_kv_cache_events:
        return None
    info = dataclasses.asdict(config)
    sink = getattr(core.kv_events, "sink", None)
    for key in ("endpoint", "replay_endpoint"):
        if getattr(sink, key, None):
            info[key] = getattr(sink, key)
    return info
