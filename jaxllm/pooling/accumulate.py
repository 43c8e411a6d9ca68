"""The host side of pooling: each step brings one pooled row per scheduled request (the sum of its chunk's
hidden states for MEAN, the first prompt token's for CLS, the chunk's last token's for LAST); a request's rows
are added across its prefill chunks (MEAN's running sum) and, once its last chunk ran, turned into the embedding:
divided by the prompt length (MEAN), cut to `dimensions` (Matryoshka), L2-normalised. Numpy, no JAX."""

from __future__ import annotations

import numpy as np

from jaxllm.config import PoolerConfig
from jaxllm.pooling.params import PoolingParams


class PoolingAccumulator:
    def __init__(self, pooler: PoolerConfig):
        self.pooler = pooler
        self._sums: dict[str, np.ndarray] = {}

    def add(self, request_id: str, start: int, num_new: int, num_prompt: int, row: np.ndarray) -> None:
        """One step's pooled row of a request whose chunk covered prompt positions start..start+num_new-1."""
        kind = self.pooler.pooling_type
        if kind == "MEAN":  # (a chunk from position 0 starts the sum again: a preempted request is recomputed)
            total = self._sums.get(request_id)
            self._sums[request_id] = row.astype(np.float64) if total is None or start == 0 else total + row
        elif (kind == "CLS" and start == 0) or (kind == "LAST" and start + num_new >= num_prompt):
            self._sums[request_id] = row.astype(np.float64)

    def finish(self, request_id: str, num_prompt: int, params: PoolingParams) -> list[float]:
        """The request's embedding (its rows forgotten)."""
        pooled = self._sums.pop(request_id)
        if self.pooler.pooling_type == "MEAN":
            pooled = pooled / num_prompt
        if params.dimensions is not None:
            pooled = pooled[: params.dimensions]
        normalize = params.normalize if params.normalize is not None else self.pooler.normalize
        if normalize:
            pooled = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
        return pooled.astype(np.float32).tolist()

    def drop(self, request_id: str) -> None:
        """Forget a request that ended without an embedding (aborted, failed)."""
        self._sums.pop(request_id, None)
