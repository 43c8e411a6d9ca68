"""HF architecture name → jaxllm model, and the `ModelArch` read from an HF config.

`ModelArch` is everything the compiled forward needs to know about a model, as a
frozen (hashable) dataclass so it can be a static attribute of the Flax module.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

DENSE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# mixtures of experts: a layer's MLP is a routed set of experts (model/moe.py), or dense between them
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "GptOssForCausalLM",
)
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# the gated MLP's activation: transformers' names (`hidden_act`, Gemma's `hidden_activation`) → jaxllm's
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rotary_dim: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def inv_freq_and_scale(self, max_position_embeddings: int) -> tuple[np.ndarray, float]:
        """Inverse frequencies (float32, [rotary_dim/2]) and the cos/sin scale, as transformers computes them."""
        dim = self.rotary_dim
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
        inv_freq = (1.0 / (self.theta**exponents)).astype(np.float32)
        if self.rope_type == "default":
            return inv_freq, 1.0
        if self.rope_type == "linear":
            return (inv_freq / self.factor).astype(np.float32), 1.0
        if self.rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, self), 1.0
        if self.rope_type == "yarn":
            return _yarn_inv_freq_and_scale(self, max_position_embeddings)
        raise NotImplementedError(f"rope type {self.rope_type!r} is not supported (default, linear, llama3, yarn are)")


def _llama3_inv_freq(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    old_len = rope.original_max_position_embeddings
    if old_len is None:  # arch_from_hf_config refuses such a config first
        raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq_and_scale(rope: RopeConfig, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    dim, base = rope.rotary_dim, rope.theta
    original = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scale = rope.attention_factor
    if scale is None:
        if rope.mscale and rope.mscale_all_dim:
            scale = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        else:
            scale = mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32), float(scale)


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: each token's `top_k` of `num_experts` SwiGLU experts, weighted by the router's softmax."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # renormalise the chosen experts' weights to sum to one
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, gated by a sigmoid
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is dense instead (mlp_only_layers, decoder_sparse_step)
    expert_parallel: bool = False  # experts split whole over the "model" axis (else each expert's columns)
    biases: bool = False  # gpt-oss: the router and every expert's projections have biases
    # gpt-oss's clamped SwiGLU, (alpha, limit): (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, limit); None: SwiGLU
    clamped_glu: tuple[float, float] | None = None


@dataclass(frozen=True)
class GemmaStyle:
    """What Gemma 2 and 3 do differently from a Llama-family decoder."""

    query_pre_attn_scalar: float  # attention scores scaled by its inverse square root (not head_dim's)
    attn_softcap: float | None = None  # scores → cap * tanh(scores / cap) (Gemma 2: 50)
    final_softcap: float | None = None  # logits → cap * tanh(logits / cap) (Gemma 2: 30)
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding-window layers' own RoPE (base 10k)


@dataclass(frozen=True)
class LayerKind:
    """What a decoder layer runs, as far as its parameters and compiled code differ from another's: the decoder
    scans each run of consecutive layers of one kind as one stack (`ModelArch.layer_runs`)."""

    experts: bool = False  # its MLP is the mixture of experts (else the dense gated MLP)
    sliding_window: int | None = None  # its attention's window (None: full attention)


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None  # the layers `sliding_window` applies to; None: every layer
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # layers' MLPs are mixtures of experts (but `moe.dense_layers`)
    qk_norm_whole: bool = False  # OLMoE: q/k norms over the whole projection, not per head
    hidden_act: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh" (`ACTIVATIONS`)
    # Gemma: RMSNorm scales by 1 + w, embeddings times sqrt(hidden), norms after attention and around the MLP
    gemma: GemmaStyle | None = None
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each row's softmax denominator

    def layer_kind(self, layer: int) -> LayerKind:
        experts = self.moe is not None and layer not in self.moe.dense_layers
        windowed = self.sliding_layers is None or layer in self.sliding_layers
        return LayerKind(experts=experts, sliding_window=self.sliding_window if windowed else None)

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), what its KV cache group follows."""
        return tuple(self.layer_kind(i).sliding_window for i in range(self.num_layers))

    def stage(self, start: int, end: int) -> ModelArch:
        """Layers `start:end` as a model of their own (a pipeline stage): per-layer settings renumbered from 0."""

        def local(layers: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(i - start for i in layers if start <= i < end)

        moe = self.moe and dataclasses.replace(self.moe, dense_layers=local(self.moe.dense_layers))
        sliding = None if self.sliding_layers is None else local(self.sliding_layers)
        return dataclasses.replace(self, num_layers=end - start, sliding_layers=sliding, moe=moe)

    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts."""
        return tuple(i for i in range(self.num_layers) if self.layer_kind(i).experts)

    def layer_runs(self) -> tuple[tuple[int, int, LayerKind], ...]:
        """(first layer, end, kind) of each run of consecutive layers of one kind, in order."""
        runs: list[tuple[int, int, LayerKind]] = []
        for layer in range(self.num_layers):
            kind = self.layer_kind(layer)
            if runs and runs[-1][2] == kind:
                runs[-1] = (runs[-1][0], layer + 1, kind)
            else:
                runs.append((layer, layer + 1, kind))
        return tuple(runs)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, all layers, per element byte (multiply by the dtype's itemsize)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _rope_parameters(config: Any, layer_type: str = "full_attention") -> dict:
    """transformers 5 keeps rope settings in `rope_parameters` (Gemma 3: one dict per layer type); 4.x in
    `rope_theta` + `rope_scaling`."""
    params = dict(_get(config, "rope_parameters") or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = _get(config, "rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if params.get("rope_theta") is None:
        params["rope_theta"] = _get(config, "rope_theta") or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _sliding_window(config: Any, architecture: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(the window, the layers that use it: None for every layer) as transformers reads them (`layer_types`)."""
    window = _get(config, "sliding_window")
    layer_types = _get(config, "layer_types")
    if layer_types:
        kinds = set(layer_types)
        unknown = kinds - {"full_attention", "sliding_attention"}
        if unknown:
            raise NotImplementedError(f"{architecture}: layer types {sorted(unknown)} are not supported")
        if kinds == {"full_attention"} or not window:
            return None, None
        if kinds == {"sliding_attention"}:
            return window, None
        return window, tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if architecture == "MistralForCausalLM":
        return window, None
    if architecture in GEMMA and window:  # Hub configs before `layer_types`: every n-th layer is global
        pattern = _get(config, "sliding_window_pattern") or _get(config, "_sliding_window_pattern")
        pattern = int(pattern or (2 if architecture == "Gemma2ForCausalLM" else 6))
        num_layers = _get(config, "num_hidden_layers")
        return window, tuple(i for i in range(num_layers) if (i + 1) % pattern)
    return None, None


def _rope(config: Any, architecture: str, head_dim: int, max_pos: int, rope: dict) -> RopeConfig:
    """One RoPE's settings (`_rope_parameters`), checked: ValueError / NotImplementedError naming the field."""
    rope_cfg = RopeConfig(
        theta=float(rope["rope_theta"]),
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
        rope_type=rope["rope_type"],
        factor=float(rope.get("factor") or 1.0),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=rope.get("original_max_position_embeddings"),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"),
        truncate=bool(rope.get("truncate", True)),
    )
    if rope_cfg.rotary_dim != head_dim:
        raise NotImplementedError(f"{architecture}: partial rotary embeddings are not supported")
    if rope_cfg.rope_type == "llama3" and rope_cfg.original_max_position_embeddings is None:
        raise ValueError(f"{architecture}: llama3 rope scaling needs original_max_position_embeddings")
    rope_cfg.inv_freq_and_scale(max_pos)  # fail now on an unsupported rope type
    return rope_cfg


def _gemma(config: Any, architecture: str, head_dim: int, max_pos: int) -> GemmaStyle | None:
    """Gemma 2/3's settings; Gemma 3's sliding layers' RoPE from `rope_parameters["sliding_attention"]`
    (transformers 5) or the Hub configs' `rope_local_base_freq` (default RoPE, base 10k)."""
    if architecture not in GEMMA:
        return None
    local = None
    if architecture == "Gemma3ForCausalLM":
        params = _get(config, "rope_parameters") or {}
        if isinstance(params.get("sliding_attention"), dict):
            local_params = _rope_parameters(config, "sliding_attention")
        else:
            local_params = {"rope_type": "default", "rope_theta": _get(config, "rope_local_base_freq") or 10000.0}
        local = _rope(config, architecture, head_dim, max_pos, local_params)
    scalar = _get(config, "query_pre_attn_scalar") or head_dim
    soft = lambda name: float(v) if (v := _get(config, name)) else None  # noqa: E731
    return GemmaStyle(float(scalar), soft("attn_logit_softcapping"), soft("final_logit_softcapping"), local)


def arch_from_hf_config(config: Any) -> ModelArch:
    """Read a `ModelArch` from a transformers config object or its dict."""
    architectures = _get(config, "architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture is None:
        model_type = _get(config, "model_type")
        architecture = MODEL_TYPES.get(model_type, str(model_type))
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; jaxllm supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    quantized = _get(config, "quantization_config")
    method = _get(quantized, "quant_method", "unknown") if quantized else None
    if method is not None and (method, architecture) != ("mxfp4", "GptOssForCausalLM"):  # (weights/mxfp4.py)
        raise NotImplementedError(
            f"{architecture}: checkpoints quantized with {method!r} are not supported; use an unquantized (bf16) "
            f"checkpoint, which `quantization='int8'`/'int4' quantizes at load, or a GGUF file"
        )
    hidden = _get(config, "hidden_size")
    num_heads = _get(config, "num_attention_heads")
    head_dim = _get(config, "head_dim") or hidden // num_heads
    max_pos = _get(config, "max_position_embeddings") or 2048
    rope_cfg = _rope(config, architecture, head_dim, max_pos, _rope_parameters(config))
    default_act = "gelu_pytorch_tanh" if architecture in GEMMA else "silu"  # (transformers' config defaults)
    act = _get(config, "hidden_activation") or _get(config, "hidden_act") or default_act  # (Gemma's name first)
    if act not in ACTIVATIONS:
        raise NotImplementedError(f"{architecture}: activation {act!r} is not supported ({', '.join(ACTIVATIONS)} are)")

    num_kv_heads = _get(config, "num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{architecture}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    attention_bias = bool(_get(config, "attention_bias", False))
    window, sliding_layers = _sliding_window(config, architecture)
    eos = _get(config, "eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return ModelArch(
        architecture=architecture,
        vocab_size=_get(config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_get(config, "intermediate_size"),
        num_layers=_get(config, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        rope=rope_cfg,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias or architecture in QWEN2_FAMILY,
        o_bias=attention_bias and architecture not in QWEN2_FAMILY,
        mlp_bias=bool(_get(config, "mlp_bias", False)),
        qk_norm=architecture in QK_NORM,
        sliding_window=window,
        sliding_layers=sliding_layers,
        eos_token_ids=eos_ids,
        moe=_moe(config, architecture) if architecture in MOE_ARCHITECTURES else None,
        qk_norm_whole=architecture == "OlmoeForCausalLM",
        hidden_act=ACTIVATIONS[act],
        gemma=_gemma(config, architecture, head_dim, max_pos),
        attention_sinks=architecture == "GptOssForCausalLM",
    )


QWEN2_FAMILY = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")  # q/k/v biases, none on o_proj
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "Gemma3ForCausalLM")


def with_expert_parallel(arch: ModelArch, num_devices: int) -> ModelArch:
    """`arch` with its experts split whole over `num_devices` (vLLM's enable_expert_parallel); a dense model is
    returned as it is. ValueError when the experts do not split evenly."""
    if arch.moe is None:
        return arch
    if arch.moe.num_experts % num_devices:
        raise ValueError(
            f"enable_expert_parallel: {arch.architecture}'s {arch.moe.num_experts} experts do not split evenly over "
            f"tensor_parallel_size={num_devices} devices"
        )
    return dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, expert_parallel=True))


def _moe(config: Any, architecture: str) -> MoEConfig:
    """The routing fields as transformers reads them for `architecture`; a layout jaxllm cannot run is refused."""
    num_experts = _get(config, "num_experts") or _get(config, "num_local_experts")  # Qwen3-MoE saves the latter
    top_k = _get(config, "num_experts_per_tok")
    if not num_experts or not top_k:
        raise ValueError(f"{architecture}: the config has no num_experts / num_experts_per_tok")
    # transformers' rule: layer i is sparse unless listed in mlp_only_layers or (i + 1) % decoder_sparse_step
    mlp_only = {int(i) for i in _get(config, "mlp_only_layers") or []}
    step = int(_get(config, "decoder_sparse_step") or 1)
    num_layers = int(_get(config, "num_hidden_layers"))
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
    if _get(config, "topk_group") or _get(config, "n_group"):
        raise NotImplementedError(f"{architecture}: grouped top-k routing (n_group, topk_group) is not supported")
    # Mixtral always renormalises (gpt-oss's softmax over the top-k logits is the same); the others say so in
    # norm_topk_prob (OLMoE and Qwen2-MoE default False)
    always = architecture in ("MixtralForCausalLM", "GptOssForCausalLM")
    norm = always or bool(_get(config, "norm_topk_prob", False))
    size = _get(config, "moe_intermediate_size") or _get(config, "intermediate_size")
    shared = (_get(config, "shared_expert_intermediate_size") or 0) if architecture == "Qwen2MoeForCausalLM" else 0
    if top_k > num_experts:
        raise ValueError(f"{architecture}: num_experts_per_tok={top_k} exceeds num_experts={num_experts}")
    if architecture == "GptOssForCausalLM":
        glu = (float(_get(config, "swiglu_alpha", 1.702)), float(_get(config, "swiglu_limit", 7.0)))
        return MoEConfig(int(num_experts), int(top_k), int(size), norm, 0, dense, biases=True, clamped_glu=glu)
    return MoEConfig(int(num_experts), int(top_k), int(size), norm, int(shared), dense)
