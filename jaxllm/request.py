"""A request inside the engine, and its status machine.

WAITING → RUNNING ⇄ PREEMPTED (back in the waiting queue, recomputed later) → FINISHED_*; with a KV connector
loading its prefix asynchronously, WAITING → WAITING_FOR_REMOTE_KVS (blocks allocated, nothing scheduled) →
WAITING once the load ended (loaded, or failed and recomputed).
Tokens are split in two: `prompt_token_ids` and `output_token_ids`; `num_computed_tokens`
counts how many of all of them have K/V in the cache.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxllm.outputs import Logprob, RequestMetrics
from jaxllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxllm.lora.request import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_FSM = "waiting_for_fsm"  # structured outputs: held by the engine until its grammar compiled
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # KV connector: its prefix's K/V is being loaded
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED  # a plain attribute: this runs for every request every step

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = frozenset(s.value for s in RequestStatus if s.name.startswith("FINISHED"))


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    priority: int = 0  # lower is served first (vLLM's convention)
    arrival_time: float = field(default_factory=time.monotonic)
    sample_seed: int = 0  # seeds this request's sampling stream
    index: int = 0  # which of a parent's n samples this is
    parent_id: str | None = None  # the user's request id, for n > 1
    user: str | None = None  # the tenant, for fair scheduling (the OpenAI API's `user` field)
    expected_output_len: int | None = None  # a predicted output length, for length-aware policies (sjf)
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with
    lora_scope: bytes = b""  # the adapter's identity and weights digest: roots its KV block hashes (lora/manager.py)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""  # detokenized output released so far (safe to stream: no partial stop strings)
    num_computed_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # speculation: proposed for the next step
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)  # filled as the prompt is computed
    stop_reason: int | str | None = None
    error: str | None = None
    num_external_tokens: int = 0  # KV connector: tokens whose K/V an asynchronous load is bringing
    kv_transfer_params: dict | None = None  # KV connector: what its output tells a consumer (P/D producer)
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self):
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def output_key(self) -> str:
        """The id the user sees (children of an n > 1 request share their parent's)."""
        return self.parent_id or self.request_id
