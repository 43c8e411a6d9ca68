"""Scores from embeddings: the cosine similarity of two vectors (vLLM's score for embedding models), and the
pairing rules of `LLM.score` and `/score` (1-to-1, 1-to-N, N-to-N)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(x @ y / max(float(np.linalg.norm(x) * np.linalg.norm(y)), 1e-12))


def pair_up(text_1: list, text_2: list) -> list[tuple[int, int]]:
    """Index pairs: one text_1 against every text_2, or text_1[i] against text_2[i] (ValueError otherwise)."""
    if not text_1 or not text_2:
        raise ValueError("text_1 and text_2 must each hold at least one input")
    if len(text_1) == 1:
        return [(0, j) for j in range(len(text_2))]
    if len(text_1) != len(text_2):
        raise ValueError(f"text_1 has {len(text_1)} inputs and text_2 {len(text_2)}: give one text_1, or as many")
    return [(i, i) for i in range(len(text_1))]
