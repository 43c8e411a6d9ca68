"""The request-trace format shared by `jaxllm bench serve --dataset jsonl`, `jaxllm trace synth`
and `jaxllm simulate`: JSON Lines, one request per line, in arrival order.

    {"arrival_time": 0.12, "prompt_len": 128, "output_len": 64,
     "priority": 0, "user": "tenant-a", "prefix_group": "g1", "prefix_len": 96}

- `arrival_time`: seconds from the start of the run.
- the prompt: `prompt` (text), `prompt_token_ids` (a list), or `prompt_len` (a length; the
  tokens are then made up deterministically by `prompt_token_ids`, below).
- `output_len`: tokens to generate (replayed exactly with min_tokens = max_tokens, EOS ignored).
- optional: `priority` (lower is served first), `user` (the tenant, for fair scheduling),
  `prefix_group` + `prefix_len` (requests of one group share their first `prefix_len` tokens),
  `acceptance_rate` (speculative decoding, simulator only: the chance that a draft token of this
  request is accepted given the one before it was; absent: `jaxllm simulate --acceptance-rate`),
  `session` (a conversation: the router's affinity key; with `prompt_len`, the turns of one session
  are one growing conversation — after the group's prefix, the session's own made-up tokens, so a
  later, longer turn starts with the whole prompt of an earlier one and hits its cached blocks).

Made-up tokens depend only on (seed, group or request index), so a simulator and a real server
replaying the same trace see the same token ids — and the same prefix-cache hits.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

# made-up prompt tokens are drawn from this id range: ordinary word pieces in common vocabularies
# (clear of the special tokens at the start of most vocabularies), so any model can replay a trace
TOKEN_RANGE = (1000, 30000)


@dataclass
class TraceRequest:
    arrival_time: float
    output_len: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_len: int | None = None
    priority: int = 0
    user: str | None = None
    prefix_group: str | None = None
    prefix_len: int = 0
    acceptance_rate: float | None = None
    session: str | None = None

    def __post_init__(self):
        given = [k for k in ("prompt", "prompt_token_ids", "prompt_len") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a trace request needs exactly one of prompt, prompt_token_ids, prompt_len; got {given}")
        if not isinstance(self.output_len, int) or self.output_len < 1:
            raise ValueError(f"output_len must be an integer >= 1, got {self.output_len!r}")
        if not isinstance(self.arrival_time, (int, float)) or self.arrival_time < 0:
            raise ValueError(f"arrival_time must be a number >= 0, got {self.arrival_time!r}")
        if self.prompt_len is not None and (not isinstance(self.prompt_len, int) or self.prompt_len < 1):
            raise ValueError(f"prompt_len must be an integer >= 1, got {self.prompt_len!r}")
        if self.prefix_group is not None and not 0 <= self.prefix_len <= (self.prompt_len or 0):
            raise ValueError(f"prefix_len must be in [0, prompt_len] for a prefix group, got {self.prefix_len!r}")
        rate = self.acceptance_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1):
            raise ValueError(f"acceptance_rate must be a number in [0, 1], got {rate!r}")

    @property
    def num_prompt_tokens(self) -> int | None:
        """The prompt's length when the trace fixes it (None for text prompts: the tokenizer decides)."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return self.prompt_len

    def to_json(self) -> dict:
        return {
            k: v
            for k, v in asdict(self).items()
            if v is not None and not (k == "prefix_len" and not v) and not (k == "priority" and v == 0)
        }


def prompt_token_ids(request: TraceRequest, index: int, seed: int = 0) -> list[int]:
    """The request's prompt tokens: as given, or made up from (seed, prefix group, session or index)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if request.prompt_len is None:
        raise ValueError("a text prompt has no token ids before tokenization")
    prefix: list[int] = []
    if request.prefix_group is not None and request.prefix_len:
        prefix = _made_up_tokens(f"{seed}/group/{request.prefix_group}", request.prefix_len)
    own = f"{seed}/session/{request.session}" if request.session is not None else f"{seed}/request/{index}"
    return prefix + _made_up_tokens(own, request.prompt_len - len(prefix))


def _made_up_tokens(key: str, n: int) -> list[int]:
    """`n` token ids drawn from a generator seeded by `key` (a stable digest: the same in every process); the
    first m of them are the `m` drawn for a shorter length (a session's turns extend one another)."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(*TOKEN_RANGE, size=n).tolist()


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace; a bad line raises ValueError naming the line. Sorted by arrival time."""
    known = {f.name for f in fields(TraceRequest)}
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                unknown = set(row) - known
                if unknown:
                    raise ValueError(f"unknown fields {sorted(unknown)}")
                requests.append(TraceRequest(**row))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    return sorted(requests, key=lambda r: r.arrival_time)


def save_trace(requests: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for request in requests:
            f.write(json.dumps(request.to_json()) + "\n")
