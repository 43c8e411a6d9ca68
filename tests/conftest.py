"""Shared test set-up: JAX on CPU in float32, with enough host devices for sharding tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model, loaded once per test session (float32, one device)."""
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.weights import load_model

    return load_model(None, mesh=make_mesh(), dtype="float32")


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' PyTorch model loading the same GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.weights.default import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
