"""The pooler a model gets: explicit settings first, then its sentence-transformers files (`modules.json`,
`1_Pooling/config.json`, a Normalize module), then vLLM's default for a decoder (LAST, L2-normalised). Whether
`dimensions` may shorten an embedding comes from the HF config (`is_matryoshka` / `matryoshka_dimensions`, as
vLLM reads them) or the pooler settings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxllm.config import PoolerConfig

# 1_Pooling/config.json's flags → jaxllm's pooling type (the first set one wins, in this order)
_ST_MODES = (
    ("pooling_mode_lasttoken", "LAST"),
    ("pooling_mode_mean_tokens", "MEAN"),
    ("pooling_mode_cls_token", "CLS"),
)


def sentence_transformers_pooler(model_dir: Path) -> PoolerConfig | None:
    """The pooler a sentence-transformers model directory declares, or None when it has no modules.json."""
    modules_file = model_dir / "modules.json"
    if not model_dir.is_dir() or not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type, normalize = None, False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            settings = json.loads((model_dir / module.get("path", "1_Pooling") / "config.json").read_text())
            modes = [name for key, name in _ST_MODES if settings.get(key)]
            if not modes:
                raise ValueError(f"{model_dir}: its Pooling module uses no mode jaxllm supports (LAST, MEAN, CLS)")
            pooling_type = modes[0]
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def resolve_pooler(explicit: PoolerConfig | None, model_dir: Path, hf_config: dict) -> PoolerConfig:
    """Every field decided: `explicit` (LLM(pooler_config=...), --pooler-config) over the model's files over the
    defaults."""
    found = sentence_transformers_pooler(model_dir) or PoolerConfig()
    explicit = explicit or PoolerConfig()
    dims = explicit.matryoshka_dimensions or hf_config.get("matryoshka_dimensions")
    return dataclasses.replace(
        found,
        pooling_type=explicit.pooling_type or found.pooling_type or "LAST",
        normalize=explicit.normalize if explicit.normalize is not None else found.normalize is not False,
        is_matryoshka=bool(explicit.is_matryoshka or hf_config.get("is_matryoshka") or dims),
        matryoshka_dimensions=tuple(dims) if dims else None,
    )


def check_dimensions(pooler: PoolerConfig, dimensions: int | None, hidden_size: int) -> None:
    """A request's `dimensions`: only for a Matryoshka-trained model, and one it was trained for (ValueError)."""
    if dimensions is None:
        return
    if not pooler.is_matryoshka:
        raise ValueError("dimensions: this model is not Matryoshka-trained, so it cannot shorten its embeddings")
    allowed = pooler.matryoshka_dimensions
    if allowed is not None and dimensions not in allowed:
        raise ValueError(f"dimensions must be one of {list(allowed)}, got {dimensions}")
    if dimensions > hidden_size:
        raise ValueError(f"dimensions must be at most the embedding size {hidden_size}, got {dimensions}")
