"""SamplingParams: how to sample one request, validated when constructed (vLLM's fields and meanings)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from typing import Any

MAX_LOGIT_BIAS = 300  # entries of logit_bias per request (OpenAI's limit)
MAX_LOGPROBS = 20  # top logprobs per token the engine computes at most (vLLM's default max_logprobs)


@dataclass
class StructuredOutputsParams:
    """Constrain the output to exactly one of: a JSON schema, any JSON object, a regex, one of
    `choice`, or a Lark/GBNF `grammar` (vLLM's fields). Checked with llguidance at construction:
    a bad schema, regex or grammar is a ValueError naming the problem.

    JSON is compact (no whitespace between tokens) unless `whitespace_pattern` says otherwise.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    kind: str = field(init=False)  # which constraint: json, json_object, regex, choice or grammar
    llguidance_grammar: str = field(init=False, repr=False)  # the checked grammar the engine compiles

    def __post_init__(self):
        from jaxllm.structured.grammar import grammar_text

        given = [
            k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, k) not in (None, False)
        ]
        if len(given) != 1:
            found = f"got {' and '.join(given)}" if given else "got none"
            raise ValueError(
                f"StructuredOutputsParams takes exactly one of json, json_object, regex, choice, grammar; {found}"
            )
        self.kind = given[0]
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"StructuredOutputsParams.json_object must be True or None, got {self.json_object!r}")
        if self.whitespace_pattern is not None:
            if self.kind not in ("json", "json_object"):
                raise ValueError("StructuredOutputsParams.whitespace_pattern applies only to json and json_object")
            if not isinstance(self.whitespace_pattern, str):
                raise ValueError("StructuredOutputsParams.whitespace_pattern must be a regex string")
        try:
            self.llguidance_grammar = grammar_text(self.kind, getattr(self, self.kind), self.whitespace_pattern)
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.{self.kind}: {e}") from None


class RequestOutputKind(enum.Enum):
    """What each streamed `RequestOutput` carries (vLLM's names); `LLM.generate` only sees the final one."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


def _check_logit_bias(bias) -> dict[int, float]:
    """{token id: bias in [-100, 100]} with at most MAX_LOGIT_BIAS entries; ids may come as JSON's strings."""
    if not isinstance(bias, dict):
        raise ValueError(f"SamplingParams.logit_bias must be a dict of token id to bias, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"SamplingParams.logit_bias has {len(bias)} entries, more than {MAX_LOGIT_BIAS}")
    checked = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if isinstance(key, bool) or token < 0 or (isinstance(key, float) and key != token):
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
            raise ValueError(f"SamplingParams.logit_bias values must be numbers in [-100, 100], got {key!r}: {value!r}")
        checked[token] = float(value)
    return checked


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len; 0: the prompt only (with prompt_logprobs)
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per sampled token (the sampled one is always included)
    prompt_logprobs: int | None = None  # logprob of each prompt token, and the top-k at its position
    logit_bias: dict[int, float] | None = None  # token id → added to its logit before anything else (OpenAI's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (llguidance)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: arguments for extensions; "kv_transfer_params" talks to the KV connector (docs/disaggregated.md)
    extra_args: dict[str, Any] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        def fail(name, requirement):
            raise ValueError(f"SamplingParams.{name} must be {requirement}, got {getattr(self, name)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            fail("n", "an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            fail("temperature", "a number >= 0")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "an integer >= -1 (0 or -1 disable it)")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                fail(name, "in [-2, 2]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "a number > 0")
        if self.seed is not None and not is_int(self.seed):
            fail("seed", "an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            fail("max_tokens", "an integer >= 0 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            fail("prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            fail("stop", "a non-empty string or a list of them")
        self.stop_strings = stops
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(is_int(i) and i >= 0 for i in ids):
            fail("stop_token_ids", "a list of token ids >= 0")
        self.stop_token_ids = list(ids)
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "a RequestOutputKind")
        if self.stop_strings and not self.detokenize:
            fail("stop", "empty when detokenize=False (stop strings are matched on text)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", "a StructuredOutputsParams or None")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            fail("extra_args", "a dict or None")
        if not isinstance((self.extra_args or {}).get("kv_transfer_params", {}), dict | None):
            fail("extra_args", 'a dict whose "kv_transfer_params" is a dict')

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """What the KV connector is told about this request (P/D: do_remote_decode / do_remote_prefill ...)."""
        return (self.extra_args or {}).get("kv_transfer_params")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_child(self, index: int) -> SamplingParams:
        """The params of sample `index` of an n > 1 request: n=1, and distinct seeds (seed + index)."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        seed = None if self.seed is None else self.seed + index
        return replace(SamplingParams(**kwargs), n=1, seed=seed)
