"""The pooling runner's settings (vLLM's `runner="pooling"` and `PoolerConfig`): how a prompt's hidden states
become one embedding. Plain data: reading a model's sentence-transformers files is `jaxllm/pooling/config.py`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.config.checks import json_object, one_of

RUNNERS = ("generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """`pooling_type`: LAST (the last prompt token's hidden state), MEAN (the mean over the prompt's tokens) or
    CLS (the first token's); `normalize`: L2-normalise the embedding. None: the model's own (its
    sentence-transformers files) or, with none, LAST with normalisation, as vLLM does for a decoder.
    `matryoshka_dimensions`: the `dimensions` a request may ask for (None: any up to the hidden size when the model
    is Matryoshka-trained, else none)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", str(self.pooling_type).upper())
            one_of("pooler_config.pooling_type", self.pooling_type, POOLING_TYPES)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {self.normalize!r}")
        if self.matryoshka_dimensions is not None:
            dims = tuple(self.matryoshka_dimensions)
            if not dims or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
                raise ValueError(f"pooler_config.matryoshka_dimensions must be positive integers, got {dims!r}")
            object.__setattr__(self, "matryoshka_dimensions", dims)

    @classmethod
    def parse(cls, value: PoolerConfig | dict | str | None) -> PoolerConfig | None:
        """From `LLM(pooler_config=...)` or `--pooler-config` (JSON); unknown keys are refused by name."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        known = ("pooling_type", "normalize", "is_matryoshka", "matryoshka_dimensions")
        value = json_object("pooler_config", value, known)
        return cls(**value)


def check_runner(runner: str) -> None:
    one_of("runner", runner, RUNNERS)
