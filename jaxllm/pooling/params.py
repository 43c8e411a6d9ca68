"""PoolingParams: what one embedding request asks for (vLLM's name and fields), checked when built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the first N of the embedding (Matryoshka-trained models only), before normalising;
    `normalize`: L2-normalise (None: the pooler's setting)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self):
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
