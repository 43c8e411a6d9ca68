"""AsyncLLM: asyncio streams of `RequestOutput`s over engine cores that step outside the event loop.

`async for out in engine.generate(prompt, params, request_id)` yields outputs as tokens
arrive, shaped by `params.output_kind` (cumulative, delta or final only). The cores are
reached only through an `EngineCoreClient` (by default one core on a background thread),
which hands each step's outputs back here with `call_soon_threadsafe`: the event loop
never waits on a step, and a step never waits on the event loop. A consumer that stops
iterating (a client disconnect cancels it) aborts its request; the core frees its blocks
at its next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.core_client import EngineCoreClient, InProcessClient
from jaxllm.engine.dp_client import DataParallelClient
from jaxllm.lora.request import LoRARequest
from jaxllm.metrics.loggers import LOG_INTERVAL_S, LoggingStatLogger
from jaxllm.metrics.prometheus import PrometheusStatLogger
from jaxllm.metrics.stats import OutputStatsTracker
from jaxllm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from jaxllm.pooling.config import check_dimensions
from jaxllm.pooling.params import PoolingParams
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxllm")

PromptType = str | dict[str, Any]


class EngineDeadError(RuntimeError):
    """The engine core stopped (a bug, or the server is shutting down): no request can be served."""


class RequestStream:
    """One request's latest cumulative output, and what of it the consumer has already seen."""

    def __init__(self, kind: RequestOutputKind):
        self.kind = kind
        self.latest: RequestOutput | None = None
        self.ready = asyncio.Event()
        self.sent: dict[int, tuple[int, int]] = {}  # sample index → (tokens, characters) already yielded
        self.ended: set[int] = set()  # samples whose finish has been yielded

    def put(self, output: RequestOutput) -> None:
        self.latest = output  # outputs are cumulative: a slow consumer just skips to the newest
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        self.ready.clear()
        assert self.latest is not None  # `put` sets it before the event
        return self.latest

    def shape(self, out: RequestOutput) -> RequestOutput | None:
        """The output to yield for `out` under this stream's kind (None: nothing to yield yet)."""
        if self.kind is RequestOutputKind.CUMULATIVE:
            return out
        if self.kind is RequestOutputKind.FINAL_ONLY:
            return out if out.finished else None
        deltas = []
        for c in out.outputs:
            tokens, chars = self.sent.get(c.index, (0, 0))
            newly_ended = c.finish_reason is not None and c.index not in self.ended
            if len(c.token_ids) == tokens and len(c.text) == chars and not newly_ended:
                continue
            self.sent[c.index] = (len(c.token_ids), len(c.text))
            if newly_ended:
                self.ended.add(c.index)
            deltas.append(
                replace(
                    c,
                    text=c.text[chars:],
                    token_ids=c.token_ids[tokens:],
                    logprobs=None if c.logprobs is None else c.logprobs[tokens:],
                )
            )
        return replace(out, outputs=deltas) if deltas or out.finished else None


class AsyncLLM:
    """The async engine, as vLLM's: `from_engine_args(EngineArgs(...))`, `generate`, `abort`, `shutdown`."""

    def __init__(
        self,
        engine_args: EngineArgs,
        *,
        client_class=None,
        log_stats: bool = True,
        served_model_name: str | None = None,
        progress: bool = True,
    ):
        if client_class is None:  # data parallelism: one engine-core process per replica
            client_class = DataParallelClient if engine_args.data_parallel_size > 1 else InProcessClient
        self.client: EngineCoreClient = client_class(engine_args, self._on_outputs, self._on_dead, progress=progress)
        self.info = self.client.info
        self.tokenizer = self.info.tokenizer
        self.model_name = served_model_name or self.info.model
        self.log_stats = log_stats
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._dead: str | None = None  # why the engine cannot serve any more
        self._tracker = OutputStatsTracker()
        self._scraped_stats = list(self.client.stats())  # as of the last outputs handed to the loop
        num_engines = len(self._scraped_stats)
        self._prometheus = [PrometheusStatLogger(self.model_name, i) for i in range(num_engines)]
        self._loggers = [LoggingStatLogger(i) for i in range(num_engines)]
        self._log_task: asyncio.Task | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> AsyncLLM:
        return cls(engine_args, **kwargs)

    def get_tokenizer(self):
        return self.tokenizer

    # ---- requests ------------------------------------------------------------------------

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a str, `{"prompt": str}` or `{"prompt_token_ids": [...]}` prompt."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise ValueError(f"expected a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, got {prompt!r:.80}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]} prompts")
        return text, self.tokenizer.encode(text)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        user: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request. Bad input raises ValueError before anything is queued; an adapter
        (`lora_request`) the engine cannot read ends the request refused (its `error` says why)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if self.info.runner == "pooling":
            raise ValueError(
                "this engine runs --runner pooling (embeddings, scores): generating needs --runner generate"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        text, token_ids = self.encode_prompt(prompt)
        self.info.validate_prompt(token_ids)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            self._lora_client()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._bind_loop()
        stream = self._streams[request_id] = RequestStream(params.output_kind)
        lora = {"lora_request": lora_request} if lora_request is not None else {}  # (not every client takes one)
        self.client.add_request(
            request_id,
            token_ids,
            params,
            prompt=text,
            priority=priority,
            user=user,
            arrival_time=time.monotonic(),
            **lora,
        )
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                if (shaped := stream.shape(out)) is not None:
                    yield shaped
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer left (disconnect, cancel, break): free the request's blocks
                self.client.abort([request_id])

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        user: str | None = None,
    ) -> AsyncIterator[EmbeddingRequestOutput]:
        """vLLM's `encode`: one pooling request (runner "pooling"), batched with the others by the same scheduler;
        yields its one finished output. Bad input (a generate engine, too long, `dimensions` the model cannot
        give) raises ValueError before anything is queued; a request the engine fails raises RuntimeError."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        if self.info.runner != "pooling":
            raise ValueError("this engine runs --runner generate: embeddings and scores need --runner pooling")
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        text, token_ids = self.encode_prompt(prompt)
        self.info.validate_prompt(token_ids)
        check_dimensions(self.info.pooler, params.dimensions, self.info.hidden_size)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._bind_loop()
        stream = self._streams[request_id] = RequestStream(RequestOutputKind.FINAL_ONLY)
        self.client.add_request(request_id, token_ids, params, prompt=text, user=user, arrival_time=time.monotonic())
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
            if out.embedding is None:
                if out.refused and out.error:
                    raise ValueError(out.error)
                raise RuntimeError(f"request {request_id} failed: {out.error or 'no embedding'}")
            yield EmbeddingRequestOutput(request_id, EmbeddingOutput(out.embedding), out.prompt_token_ids)
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer left: free the request's blocks
                self.client.abort([request_id])

    async def abort(self, request_id: str | list[str]) -> None:
        self.client.abort([request_id] if isinstance(request_id, str) else list(request_id))

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) -------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (on the engine thread, between steps): ValueError or FileNotFoundError
        as the engine raises them."""
        return await asyncio.wrap_future(self._lora_client().add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests running with it finish with it); False: unknown."""
        return await asyncio.wrap_future(self._lora_client().remove_lora(lora_int_id))

    async def list_loras(self) -> list[LoRARequest]:
        return await asyncio.wrap_future(self._lora_client().list_loras())

    def add_lora_blocking(self, lora_request: LoRARequest, timeout: float | None = None) -> bool:
        """`add_lora` for start-up, before any event loop runs (`--lora-modules`): waits for the engine thread."""
        return self._lora_client().add_lora(lora_request).result(timeout)

    def _lora_client(self) -> Any:
        """The client, which must serve adapters (data-parallel clients do not: LoRA is refused there anyway)."""
        if not hasattr(self.client, "add_lora"):
            raise ValueError("LoRA adapters are not supported with this engine client (data parallelism)")
        return self.client

    def stop_accepting(self, reason: str) -> None:
        """From now on `generate` raises EngineDeadError(reason) and health checks fail; in-flight requests go on."""
        if self._dead is None:
            self._dead = reason

    def abort_all(self) -> None:
        """Abort every request in flight (shutdown): each stream ends with finish_reason "abort"."""
        self.client.abort(list(self._streams))

    # ---- outputs from the engine thread(s) -------------------------------------------------

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            if self.log_stats:
                self._log_task = loop.create_task(self._log_periodically())
        elif loop is not self._loop:
            raise RuntimeError("AsyncLLM serves one event loop; this is another")

    def _on_outputs(
        self, outputs: list[RequestOutput], engine_index: int, timestamp: float, stats: dict | None
    ) -> None:
        """Called on the client's thread: hand over to the event loop and return at once."""
        self._call_in_loop(self._dispatch, outputs, engine_index, timestamp, stats)

    def _call_in_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():  # nobody is listening any more
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _dispatch(self, outputs: list[RequestOutput], engine_index: int, timestamp: float, stats: dict | None) -> None:
        if stats is not None:
            self._scraped_stats[engine_index] = stats
        for out in outputs:
            if (stream := self._streams.get(out.request_id)) is not None:
                stream.put(out)
        iteration = self._tracker.observe(outputs, timestamp)
        self._prometheus[engine_index].record_iteration(iteration)
        self._loggers[engine_index].record_iteration(iteration)

    def _on_dead(self, message: str) -> None:
        self._dead = message
        self._call_in_loop(self._fail_all, message)

    def _fail_all(self, message: str) -> None:
        from jaxllm.engine.core_client import failed_output

        for request_id, stream in list(self._streams.items()):
            prompt_ids = stream.latest.prompt_token_ids if stream.latest else []
            stream.put(failed_output(request_id, prompt_ids, SamplingParams(), None, message))

    # ---- health and numbers ----------------------------------------------------------------

    def check_health(self) -> None:
        """Raise EngineDeadError unless every engine core is running."""
        if self._dead is not None or not self.client.is_alive():
            raise EngineDeadError(self._dead or "the engine is not running")

    def dead_engines(self) -> list[int]:
        """Data-parallel replicas that died (the others keep serving)."""
        return getattr(self.client, "dead_replicas", list)()

    @property
    def is_running(self) -> bool:
        return self._dead is None and self.client.is_alive()

    def stats(self) -> dict:
        """The engine cores' latest snapshot, summed over cores ("engines" keeps each one)."""
        per_engine = self.client.stats()
        counts = [k for k, v in per_engine[0].items() if isinstance(v, (int, float)) and k != "kv_cache_usage"]
        total = {k: sum(s[k] for s in per_engine) for k in counts}
        total["kv_cache_usage"] = sum(s["kv_cache_usage"] for s in per_engine) / len(per_engine)
        total["num_unfinished_streams"] = len(self._streams)
        return {**total, "engines": per_engine}

    def refresh_metrics(self) -> None:
        """Bring the gauges and engine counters up to date (called before each /metrics scrape).

        They come from the stats that arrived with the outputs already counted, not the cores' latest, so that a
        scrape sees a request's end and the blocks it freed together."""
        for logger_, stats in zip(self._prometheus, self._scraped_stats, strict=True):
            logger_.record_engine(stats)

    async def _log_periodically(self) -> None:
        while True:
            await asyncio.sleep(LOG_INTERVAL_S)
            now = time.monotonic()
            for stat_logger, stats in zip(self._loggers, self.client.stats(), strict=True):
                stat_logger.record_engine(stats)
                stat_logger.log(now)

    # ---- shutdown --------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._log_task is not None:
            self._log_task.cancel()
        self.client.shutdown()
        if self._dead is None:
            self._on_dead("the engine was shut down")
