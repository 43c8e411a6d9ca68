"""The model: which weights, read how, in which dtype, kept quantized how."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.config.checks import positive

DTYPES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}
LOAD_FORMATS = ("auto", "hf", "safetensors", "gguf", "orbax", "dummy")
# weights/quant/plan.py says what each keeps quantized; None (vLLM's default) means "auto"
QUANTIZATIONS = ("auto", "int8", "int4", "none")


def check_quantization(quantization) -> str:
    """`quantization` by its one name ("auto" for vLLM's None), or a ValueError listing the choices."""
    if quantization is None:
        return "auto"
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of auto (the default: a GGUF keeps its Q8_0/Q4_0/Q4_1 blocks, other "
            f"formats load as float), int8, int4, none (dequantize everything to dtype); got {quantization!r}"
        )
    return quantization


def resolve_dtype(dtype):
    """ "auto" is float32 on CPU (fastest there) and bfloat16 on accelerators. Returns a jnp dtype."""
    import jax  # lazily: the scheduler imports this module and must stay free of JAX
    import jax.numpy as jnp

    if dtype == "auto" or dtype is None:
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, {', '.join(DTYPES)}")
        return jnp.dtype(DTYPES[dtype.lower()])
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a dtype") from None
    if resolved.name not in DTYPES.values():
        raise ValueError(f"dtype {dtype!r} is not supported; use float32, bfloat16 or float16")
    return resolved


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None: the model's own limit
    attention_backend: str = "auto"
    scan_layers: bool = True  # False: unrolled layers (faster CPU decode, compile grows with depth)
    quantization: str | None = "auto"  # "auto" (None too: a GGUF keeps its blocks), "int8", "int4", "none"

    def __post_init__(self):
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype.lower() not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of auto, {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        positive("max_model_len", self.max_model_len, allow_none=True)
        object.__setattr__(self, "quantization", check_quantization(self.quantization))  # one name for the default
