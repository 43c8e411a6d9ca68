"""Weight formats: HF safetensors (single and sharded), Orbax round trip, dummy weights, and bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxllm.config import resolve_dtype
from jaxllm.entrypoints.convert import convert
from jaxllm.parallel.mesh import make_mesh
from jaxllm.weights import load_model
from jaxllm.weights.params import abstract_params
from tests.tiny_models import random_model

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Qwen2 model saved by transformers as sharded safetensors."""
    model = random_model(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**TINY))
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path, max_shard_size="20KB")
    return path, {k: v.detach().numpy() for k, v in model.state_dict().items()}


def leaves(params):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_sharded_safetensors_load_the_same_tensors(hf_dir):
    path, state = hf_dir
    assert (path / "model.safetensors.index.json").is_file()
    loaded = load_model(str(path), mesh=make_mesh(), dtype="float32")
    layers = loaded.params["layers"]
    qkv, group = layers["self_attn"]["qkv_proj"], TINY["num_attention_heads"] // TINY["num_key_value_heads"]
    np.testing.assert_array_equal(qkv["bias"][1][:, :group].reshape(-1), state["model.layers.1.self_attn.q_proj.bias"])
    np.testing.assert_array_equal(qkv["bias"][1][:, group].reshape(-1), state["model.layers.1.self_attn.k_proj.bias"])
    np.testing.assert_array_equal(
        qkv["kernel"][0][:, :, group + 1].reshape(TINY["hidden_size"], -1),
        state["model.layers.0.self_attn.v_proj.weight"].T,
    )
    gate_up = layers["mlp"]["gate_up_proj"]["kernel"][1]
    np.testing.assert_array_equal(gate_up[:, 0], state["model.layers.1.mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(gate_up[:, 1], state["model.layers.1.mlp.up_proj.weight"].T)
    np.testing.assert_array_equal(
        layers["mlp"]["down_proj"]["kernel"][0], state["model.layers.0.mlp.down_proj.weight"].T
    )
    np.testing.assert_array_equal(loaded.params["lm_head"]["kernel"], state["lm_head.weight"].T)


def test_orbax_round_trip_restores_identical_params(hf_dir, tmp_path):
    path, _ = hf_dir
    original = load_model(str(path), mesh=make_mesh(), dtype="float32")
    out = convert(str(path), str(tmp_path / "ckpt"), dtype="float32")
    assert json.loads((out / "jaxllm.json").read_text())["format"] == "jaxllm-orbax"
    restored = load_model(str(out), mesh=make_mesh(), dtype="float32")
    assert restored.arch == original.arch
    a, b = leaves(original.params), leaves(restored.params)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    with pytest.raises(FileExistsError, match="ckpt"):
        convert(str(path), str(tmp_path / "ckpt"))


def test_dummy_weights_from_a_bare_config(tmp_path):
    config = {**TINY, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path / "config.json"), mesh=make_mesh(), load_format="dummy", dtype="bfloat16")
    assert loaded.tokenizer is None
    for value in leaves(loaded.params).values():
        assert value.dtype == jnp.bfloat16 and np.isfinite(value.astype(np.float32)).all() and value.std() > 0


def test_llama3_8b_shaped_config_builds_without_allocating():
    from jaxllm.model import arch_from_hf_config

    config = json.loads(open("benchmarks/configs/llama-3-8b.json").read())
    shapes, specs = abstract_params(arch_from_hf_config(config), jnp.bfloat16)
    num_params = sum(np.prod(s.shape) for s in jax.tree.leaves(shapes))
    assert 8.0e9 < num_params < 8.1e9
    # fused weights shard over KV heads and MLP columns, never across the q/k/v or gate/up parts
    P = jax.sharding.PartitionSpec
    assert specs["layers"]["self_attn"]["qkv_proj"]["kernel"] == P(None, None, "model", None, None)
    assert shapes["layers"]["self_attn"]["qkv_proj"]["kernel"].shape == (32, 4096, 8, 4 + 2, 128)
    assert specs["layers"]["mlp"]["gate_up_proj"]["kernel"] == P(None, None, None, "model")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        load_model(str(tmp_path / "nowhere.gguf"), mesh=make_mesh())


def test_corrupt_gguf_is_named(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(256))
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(str(bad), mesh=make_mesh())


def test_corrupt_safetensors_is_named(hf_dir, tmp_path):
    path, _ = hf_dir
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    victim = sorted(tmp_path.glob("*.safetensors"))[0]
    victim.write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError, match=victim.name):
        load_model(str(tmp_path), mesh=make_mesh())


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), mesh=make_mesh(), load_format="dummy")


@pytest.mark.parametrize("bad", ["int8", "float64", "fp8"])
def test_unusable_dtype_is_named(bad):
    with pytest.raises(ValueError, match=bad):
        resolve_dtype(bad)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32"])
def test_gguf_tensors_dequantize_as_the_gguf_package_does(kind):
    """jaxllm dequantizes many rows per call of the package's row dequantizer, not its 16: same values."""
    import gguf

    from jaxllm.weights.gguf import DEQUANTIZE_ROWS, _dequantize

    qtype = gguf.GGMLQuantizationType[kind]
    values = np.random.default_rng(0).standard_normal((2, DEQUANTIZE_ROWS + 37, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)  # bytes as the file holds them (a ragged last chunk of rows)
    got = _dequantize(raw, qtype)
    assert got.dtype == np.float32 and got.shape == values.shape
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qtype))
    assert np.abs(got - values).mean() < 0.1  # and they are the values (not, say, zeros)
