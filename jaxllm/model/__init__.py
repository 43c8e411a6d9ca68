"""The model: architecture registry, layers and the Llama-family decoder."""

from jaxllm.model.llama import CausalLM, KVCache, StepInputs
from jaxllm.model.registry import SUPPORTED_ARCHITECTURES, ModelArch, arch_from_hf_config

__all__ = ["CausalLM", "KVCache", "StepInputs", "ModelArch", "SUPPORTED_ARCHITECTURES", "arch_from_hf_config"]
