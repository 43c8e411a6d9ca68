"""jaxllm.lora.peft: PEFT LoRA checkpoints in jaxllm's fused layouts, checked against PEFT's own merge, and the
adapters it must refuse."""

import dataclasses
import hashlib
import json
import shutil

import numpy as np
import peft
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers

from jaxllm.lora.peft import PROJECTIONS, load_peft_adapter
from jaxllm.model.registry import arch_from_hf_config
from jaxllm.weights.params import host_params_from_hf_tensors
from tests.tiny_models import random_model

LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# each fused projection's kernel in the parameter tree
KERNELS = {
    "qkv_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


def make_adapter(directory, targets, r=4, alpha=8, use_rslora=False, config=LLAMA, seed=0):
    """A PEFT LoRA adapter with random A and B (PEFT's default B = 0 would make every delta zero), saved to
    `directory`; returns the PEFT model."""
    hf_config = transformers.LlamaConfig(**config)
    model = random_model(transformers.LlamaForCausalLM, hf_config, seed=seed)
    lora = peft.LoraConfig(
        r=r, lora_alpha=alpha, use_rslora=use_rslora, target_modules=targets, init_lora_weights=False
    )
    torch.manual_seed(seed + 1)
    peft_model = peft.get_peft_model(model, lora)
    peft_model.save_pretrained(str(directory))
    return peft_model


def arch_of(config=LLAMA):
    return arch_from_hf_config(transformers.LlamaConfig(**config))


def merged_fused_deltas(peft_model, arch):
    """(merged - base) weights of every transformers tensor, fused by jaxllm's own loader: the kernels the adapter
    adds to, `[L, K, *out]`, by fused name."""
    base = {k: v.detach().clone() for k, v in peft_model.get_base_model().state_dict().items()}
    base = {k.replace(".base_layer", ""): v for k, v in base.items() if "lora_" not in k}
    merged = peft_model.merge_and_unload().state_dict()
    delta = {k: (merged[k] - base[k]).numpy() for k in merged}
    params = host_params_from_hf_tensors(arch, np.float32, delta.__getitem__, "merged - base")
    return {name: params["layers"][parent][module]["kernel"] for name, (parent, module) in KERNELS.items()}


def lora_out(weights, name, layer, x):
    """The adapter's fused delta for inputs x [T, K], `[T, *out]`."""
    a, b = weights.projections[name]
    return (np.einsum("tk,kr->tr", x, a[layer]) @ b[layer].reshape(b.shape[1], -1)).reshape(len(x), *b.shape[2:])


CASES = {
    "all seven": dict(targets=ALL_SEVEN, r=4, alpha=8, use_rslora=False, max_rank=8),
    "q and v": dict(targets=["q_proj", "v_proj"], r=8, alpha=16, use_rslora=True, max_rank=8),
    "mlp": dict(targets=["gate_proj", "up_proj", "down_proj"], r=2, alpha=5, use_rslora=False, max_rank=4),
    "regex k and o": dict(
        targets=r".*self_attn\.(k_proj|o_proj)", r=4, alpha=3, use_rslora=True, max_rank=6, modules=["k_proj", "o_proj"]
    ),
    "mha all seven": dict(
        targets=ALL_SEVEN, r=3, alpha=7, use_rslora=False, max_rank=4, config={**LLAMA, "num_key_value_heads": 4}
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_fused_deltas_match_peft_merge(case, tmp_path):
    c = CASES[case]
    config = c.get("config", LLAMA)
    arch, rank = arch_of(config), c["max_rank"]
    peft_model = make_adapter(tmp_path, c["targets"], c["r"], c["alpha"], c["use_rslora"], config)
    scaling = c["alpha"] / (np.sqrt(c["r"]) if c["use_rslora"] else c["r"])
    weights = load_peft_adapter(str(tmp_path), arch, rank)
    assert weights.targets == tuple(sorted(c.get("modules", c["targets"])))
    assert (weights.rank, weights.scaling) == (c["r"], pytest.approx(scaling))
    lora_layer = next(m for m in peft_model.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    assert weights.scaling == pytest.approx(lora_layer.scaling["default"])

    deltas = merged_fused_deltas(peft_model, arch)
    rng = np.random.default_rng(0)
    assert set(weights.projections) == set(PROJECTIONS)
    for name, kernel in deltas.items():
        a, b = weights.projections[name]
        parts = len(PROJECTIONS[name])
        assert a.shape == (arch.num_layers, kernel.shape[1], parts * rank) and a.dtype == np.float32
        assert b.shape == (arch.num_layers, parts * rank, *kernel.shape[2:]) and b.dtype == np.float32
        assert a.flags.c_contiguous and b.flags.c_contiguous
        unused = np.ones(parts * rank, bool)
        for p in range(parts):
            unused[p * rank : p * rank + c["r"]] = False
        assert not a[:, :, unused].any() and not b[:, unused].any()  # the padding between rank slots
        for layer in range(arch.num_layers):
            x = rng.standard_normal((5, kernel.shape[1])).astype(np.float32)
            expected = np.einsum("tk,k...->t...", x, kernel[layer])
            np.testing.assert_allclose(lora_out(weights, name, layer, x), expected, rtol=1e-5, atol=1e-5)
        if not any(m in weights.targets for m in PROJECTIONS[name]):
            assert not a.any() and not b.any()


def test_qkv_placement_by_the_documented_layout(tmp_path):
    """q/k/v's B rows land where model/llama.py's Attention reads q, k and v from the fused output, computed here
    from PEFT's per-module deltas (B @ A * scaling) without jaxllm's fusing code."""
    peft_model = make_adapter(tmp_path, ["q_proj", "k_proj", "v_proj"], r=4, alpha=8)
    arch = arch_of()
    weights = load_peft_adapter(str(tmp_path), arch, 4)
    hkv, group, d = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim
    x = np.random.default_rng(1).standard_normal((3, arch.hidden_size)).astype(np.float32)
    for layer in range(arch.num_layers):
        attn = peft_model.base_model.model.model.layers[layer].self_attn
        delta = {
            m: getattr(attn, m).get_delta_weight("default").detach().numpy() for m in ("q_proj", "k_proj", "v_proj")
        }
        out = lora_out(weights, "qkv_proj", layer, x)  # [T, Hkv, G + 2, D]
        q = (x @ delta["q_proj"].T).reshape(3, hkv * group, d)
        for h in range(arch.num_heads):
            np.testing.assert_allclose(out[:, h // group, h % group], q[:, h], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[:, :, group], (x @ delta["k_proj"].T).reshape(3, hkv, d), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            out[:, :, group + 1], (x @ delta["v_proj"].T).reshape(3, hkv, d), rtol=1e-5, atol=1e-5
        )


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A saved q/k/v/o + down adapter, r=4: the refusal tests copy and edit it."""
    directory = tmp_path_factory.mktemp("adapter")
    make_adapter(directory, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], r=4, alpha=8)
    return directory


def copy_with_config(adapter, tmp_path, **changes):
    directory = tmp_path / "copy"
    shutil.copytree(adapter, directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return directory


def rewrite_tensors(directory, edit):
    """Replace the adapter's tensors by `edit(tensors)` (made contiguous: safetensors' numpy save writes
    non-contiguous arrays wrongly)."""
    file = directory / "adapter_model.safetensors"
    tensors = edit(safetensors.numpy.load_file(str(file)))
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(file))


REFUSED = [
    ("peft_type", "LOHA"),
    ("modules_to_save", ["lm_head"]),
    ("use_dora", True),
    ("rank_pattern", {"q_proj": 2}),
    ("alpha_pattern", {"q_proj": 16}),
    ("layers_to_transform", [0]),
    ("layers_to_transform", 0),
    ("bias", "all"),
    ("bias", "lora_only"),
    ("lora_bias", True),
    ("target_parameters", ["mlp.experts.gate_up_proj"]),
    ("trainable_token_indices", [0, 1]),
    ("trainable_token_indices", {"embed_tokens": [0]}),
    ("fan_in_fan_out", True),
    ("use_qalora", True),
    ("layer_replication", [[0, 2], [1, 2]]),
    ("alora_invocation_tokens", [5, 6]),
    ("arrow_config", {"top_k": 2}),
    ("use_bdlora", {"nblocks": 2}),
    ("kasa_config", {"beta": 0.1}),
    ("monteclora_config", {"num_samples": 2}),
    ("init_lora_weights", "pissa"),
    ("init_lora_weights", "pissa_niter_4"),
    ("init_lora_weights", "olora"),
    ("init_lora_weights", "corda"),
    ("init_lora_weights", "loftq"),
    ("init_lora_weights", "lora_ga"),
]


@pytest.mark.parametrize("field, value", REFUSED, ids=[f"{f}={v!r}" for f, v in REFUSED])
def test_refused_config_fields(adapter, tmp_path, field, value):
    directory = copy_with_config(adapter, tmp_path, **{field: value})
    with pytest.raises(ValueError, match=field) as error:
        load_peft_adapter(str(directory), arch_of(), 8)
    assert str(directory) in str(error.value)


def test_peft_defaults_are_accepted(adapter, tmp_path):
    expected = load_peft_adapter(str(adapter), arch_of(), 8)
    defaults = dict(
        modules_to_save=[],
        rank_pattern={},
        alpha_pattern={},
        layers_to_transform=None,
        layers_pattern="layers",  # only read with layers_to_transform
        bias="none",
        lora_bias=False,
        target_parameters=[],
        trainable_token_indices=None,
        fan_in_fan_out=False,
        use_dora=False,
        use_qalora=False,
        init_lora_weights="gaussian",
        exclude_modules=["lm_head"],
        lora_dropout=0.1,
    )
    directory = copy_with_config(adapter, tmp_path, **defaults)
    weights = load_peft_adapter(str(directory), arch_of(), 8)
    assert weights.targets == ("down_proj", "k_proj", "o_proj", "q_proj", "v_proj")
    for name, (a, b) in weights.projections.items():
        np.testing.assert_array_equal(a, expected.projections[name][0])
        np.testing.assert_array_equal(b, expected.projections[name][1])
    assert weights.digest != expected.digest  # the config is part of it


def test_minimal_config_uses_peft_defaults(adapter, tmp_path):
    directory = tmp_path / "minimal"
    shutil.copytree(adapter, directory)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    weights = load_peft_adapter(str(directory), arch_of(), 4)
    assert (weights.rank, weights.scaling) == (4, 2.0)


def test_digest(adapter):
    weights = load_peft_adapter(str(adapter), arch_of(), 8)
    data = (adapter / "adapter_model.safetensors").read_bytes() + (adapter / "adapter_config.json").read_bytes()
    assert weights.digest == hashlib.sha256(data).hexdigest()


def test_rank_above_max_lora_rank(adapter):
    with pytest.raises(ValueError, match=r"r=4.*max_lora_rank=2"):
        load_peft_adapter(str(adapter), arch_of(), 2)


def test_missing_files(adapter, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_peft_adapter(str(tmp_path / "nowhere"), arch_of(), 8)
    no_config = tmp_path / "no_config"
    shutil.copytree(adapter, no_config)
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_peft_adapter(str(no_config), arch_of(), 8)
    bin_only = tmp_path / "bin_only"
    shutil.copytree(adapter, bin_only)
    (bin_only / "adapter_model.safetensors").rename(bin_only / "adapter_model.bin")
    with pytest.raises(FileNotFoundError, match=r"only safetensors.*adapter_model\.bin") as error:
        load_peft_adapter(str(bin_only), arch_of(), 8)
    assert str(bin_only) in str(error.value)


def test_adapter_for_another_model(adapter):
    with pytest.raises(ValueError, match=r"tensor '[^']+' has shape \((4, 64|64, 4)\).*needs \((4, 96|96, 4)\)"):
        load_peft_adapter(str(adapter), dataclasses.replace(arch_of(), hidden_size=96), 8)
    with pytest.raises(ValueError, match=r"layers\.1\..*layer 1; the model has 1 layers"):
        load_peft_adapter(str(adapter), dataclasses.replace(arch_of(), num_layers=1), 8)


@pytest.mark.parametrize("targets, tensor", [(["q_proj", "lm_head"], "lm_head"), (["embed_tokens"], "embed_tokens")])
def test_unplaceable_tensors_are_refused(tmp_path, targets, tensor):
    make_adapter(tmp_path, targets)
    with pytest.raises(ValueError, match=f"tensor '[^']*{tensor}[^']*' cannot be placed"):
        load_peft_adapter(str(tmp_path), arch_of(), 8)


def test_lora_a_without_lora_b(adapter, tmp_path):
    directory = copy_with_config(adapter, tmp_path)
    rewrite_tensors(directory, lambda t: {k: v for k, v in t.items() if "layers.1.mlp.down_proj.lora_B" not in k})
    with pytest.raises(ValueError, match="layer 1's down_proj has no lora_B"):
        load_peft_adapter(str(directory), arch_of(), 8)


def test_targeted_in_some_layers_only(adapter, tmp_path):
    full = load_peft_adapter(str(adapter), arch_of(), 8)
    directory = copy_with_config(adapter, tmp_path)
    rewrite_tensors(directory, lambda t: {k: v for k, v in t.items() if ".layers.1.self_attn." not in k})
    weights = load_peft_adapter(str(directory), arch_of(), 8)
    for name in ("qkv_proj", "o_proj"):
        a, b = weights.projections[name]
        np.testing.assert_array_equal(a[0], full.projections[name][0][0])
        np.testing.assert_array_equal(b[0], full.projections[name][1][0])
        assert not a[1].any() and not b[1].any()
    np.testing.assert_array_equal(weights.projections["down_proj"][1], full.projections["down_proj"][1])


def test_half_precision_tensors(adapter, tmp_path):
    """bfloat16 and float16 tensors (numpy has no bfloat16) read as the float32 of their values."""
    loaded = safetensors.torch.load_file(str(adapter / "adapter_model.safetensors"))
    for dtype in (torch.bfloat16, torch.float16):
        half, exact = tmp_path / str(dtype), tmp_path / f"{dtype}-as-f32"
        for directory, tensors in (
            (half, {k: v.to(dtype) for k, v in loaded.items()}),
            (exact, {k: v.to(dtype).float() for k, v in loaded.items()}),
        ):
            shutil.copytree(adapter, directory)
            safetensors.torch.save_file(tensors, str(directory / "adapter_model.safetensors"))
        half, exact = (load_peft_adapter(str(d), arch_of(), 8) for d in (half, exact))
        for name in PROJECTIONS:
            for got, want in zip(half.projections[name], exact.projections[name], strict=True):
                np.testing.assert_array_equal(got, want)


def test_lora_dtype_is_checked_and_auto_follows_the_base():
    """vLLM's `lora_dtype`: "auto" is the model's dtype, float16 on a quantized base; anything else is refused."""
    from jaxllm.config import LoRAConfig

    assert LoRAConfig().slot_dtype("float32", quantized_base=False) == "float32"
    assert LoRAConfig().slot_dtype("bfloat16", quantized_base=False) == "bfloat16"
    assert LoRAConfig().slot_dtype("float32", quantized_base=True) == "float16"
    assert LoRAConfig(lora_dtype="float32").slot_dtype("float32", quantized_base=True) == "float32"
    with pytest.raises(ValueError, match="lora_dtype must be one of auto, float32, float16, bfloat16, got 'int8'"):
        LoRAConfig(lora_dtype="int8")
