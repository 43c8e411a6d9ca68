"""Embeddings and scoring (vLLM's pooling runner): a pooling request is a prefill-only request whose step rows
come back as pooled hidden states instead of sampled tokens.

params (what a request asks: `PoolingParams`), config (the pooler a model gets: its sentence-transformers files,
or vLLM's default for a decoder), accumulate (the host side: chunk sums → the embedding), score (cosine pairs).
The device side is the step model's `pooling` variant (model/llama.py, runner/model_runner.py).
"""

from jaxllm.pooling.params import PoolingParams

__all__ = ["PoolingParams"]
