"""jaxllm: high-throughput LLM inference and serving in JAX.

The public API is imported lazily, so the pure-Python parts (scheduler, KV manager)
can be used without importing JAX.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxllm.llm",
    "SamplingParams": "jaxllm.sampling_params",
    "StructuredOutputsParams": "jaxllm.sampling_params",
    "RequestOutput": "jaxllm.outputs",
    "CompletionOutput": "jaxllm.outputs",
    "Logprob": "jaxllm.outputs",
    "EngineArgs": "jaxllm.engine.args",
    "AsyncLLM": "jaxllm.engine.async_llm",
    "RequestOutputKind": "jaxllm.sampling_params",
    "PoolingParams": "jaxllm.pooling.params",
    "EmbeddingRequestOutput": "jaxllm.outputs",
    "EmbeddingOutput": "jaxllm.outputs",
    "ScoringRequestOutput": "jaxllm.outputs",
    "ScoringOutput": "jaxllm.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
