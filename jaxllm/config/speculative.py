"""`speculative_config`: vLLM's name and JSON shape, validated before anything loads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jaxllm.config.checks import json_object

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """`num_speculative_tokens` drafts at most per request and step. n-gram: the suffix of `prompt_lookup_min` to
    `prompt_lookup_max` tokens searched for in the request's own tokens (vLLM's defaults: 5 and 5, one given sets
    the other). draft_model: `model`, anything `LLM(model=...)` takes. `disable_by_batch_size`: no drafts in a step
    with more running requests (None: the load-aware rule alone decides, see spec_decode/budget.py)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config: method "draft_model" needs "model"')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config: method "ngram" takes no "model"')
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be a positive integer, got {d!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLI's `--speculative-config`), or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        fields = json_object("speculative_config", value, cls.__dataclass_fields__)
        if "method" not in fields and "model" in fields:
            fields["method"] = "draft_model"  # vLLM infers the method from the model
        for needed in ("method", "num_speculative_tokens"):
            if needed not in fields:
                raise ValueError(f"speculative_config needs {needed!r}")
        lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        fields["prompt_lookup_min"] = lo if lo is not None else hi
        fields["prompt_lookup_max"] = hi if hi is not None else lo
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if v is not None})
