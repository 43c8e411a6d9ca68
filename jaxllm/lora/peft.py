"""PEFT LoRA checkpoints (`adapter_config.json` + `adapter_model.safetensors`) read into jaxllm's layouts.

jaxllm runs q/k/v and gate/up as one fused matmul each (weights/params.py), so an adapter's per-module factors
are laid out the same way: each fused projection gets one A `[L, K, parts * max_lora_rank]` and one B
`[L, parts * max_lora_rank, *out]`, every module's rank columns in a slot of their own, its B rows scattered to
where the fused output holds that module. The scaling is folded into B, so applying an adapter is
`(x @ A) @ B` and nothing else. Anything the checkpoint holds or asks for that this cannot place or apply
(DoRA, biases, extra saved modules, per-layer ranks, tensors of other modules) is refused, naming it: an adapter
is applied whole or not at all, never silently in part.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

from jaxllm.model.registry import ModelArch

# fused projection → the transformers modules it is made of, in the order of its rank slots
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_PARENTS |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# config fields that ask for more than `(x @ A) @ B * scaling` on the seven projections (or change which layers
# and ranks it applies to): refused unless PEFT's empty default (null, false, [] or {})
_REFUSED_FIELDS = (
    "modules_to_save",
    "use_dora",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
    "lora_bias",
    "target_parameters",
    "trainable_token_indices",
    "fan_in_fan_out",
    "use_qalora",
    "layer_replication",
    "alora_invocation_tokens",
    "arrow_config",
    "use_bdlora",
    "kasa_config",
    "monteclora_config",
)
# initialisations that leave the base weights alone; PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA change them, so such an
# adapter only fits its own modified base model (unless PEFT converted it to a plain LoRA when saving it)
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")

Factors = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]  # (layer, module) → (lora_A [r, in], lora_B [out, r])


@dataclass(frozen=True)
class LoRAWeights:
    rank: int  # the adapter's r
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    targets: tuple[str, ...]  # the transformers modules it targets, sorted
    # fused name → (A [L, K, parts * max_lora_rank], B [L, parts * max_lora_rank, *out]), float32, contiguous; all
    # four present (zeros where nothing is targeted), the scaling folded into B
    projections: dict[str, tuple[np.ndarray, np.ndarray]]
    digest: str  # sha256 of adapter_model.safetensors' bytes, then adapter_config.json's


def load_peft_adapter(path: str, arch: ModelArch, max_lora_rank: int) -> LoRAWeights:
    """The PEFT LoRA adapter in directory `path`, for a model of `arch`, in the fused layouts (`LoRAWeights`).
    FileNotFoundError for a missing directory or file; ValueError, naming the field or tensor, for an adapter
    this cannot apply whole."""
    root = Path(path)
    config_bytes, weights_bytes = _read_files(root)
    config = _parse_config(root / CONFIG_FILE, config_bytes)
    rank, scaling = _rank_and_scaling(root / CONFIG_FILE, config, max_lora_rank)
    factors = _factors(root / WEIGHTS_FILE, _read_tensors(root / WEIGHTS_FILE, weights_bytes), arch, rank)
    projections = {name: _fuse(name, factors, arch, rank, scaling, max_lora_rank) for name in PROJECTIONS}
    return LoRAWeights(
        rank=rank,
        scaling=scaling,
        targets=tuple(sorted({module for _, module in factors})),
        projections=projections,
        digest=hashlib.sha256(weights_bytes + config_bytes).hexdigest(),
    )


def _read_files(root: Path) -> tuple[bytes, bytes]:
    """(adapter_config.json's bytes, adapter_model.safetensors')."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such LoRA adapter directory")
    config_file, weights_file = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: no such file (a PEFT LoRA adapter directory needs it)")
    if not weights_file.is_file():
        bin_file = root / "adapter_model.bin"
        found = f"; {bin_file.name} is not read, re-save the adapter as safetensors" if bin_file.exists() else ""
        raise FileNotFoundError(f"{weights_file}: no such file (only safetensors adapters are read{found})")
    return config_file.read_bytes(), weights_file.read_bytes()


def _parse_config(file: Path, data: bytes) -> dict[str, Any]:
    try:
        config = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object")
    _check_config(file, config)
    return config


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def _check_config(file: Path, config: dict[str, Any]) -> None:
    """ValueError naming the first field that asks for something other than a plain LoRA."""
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type={config.get('peft_type')!r}: only LORA adapters are supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias={config['bias']!r} is not supported (only 'none': no trained biases)")
    for field in _REFUSED_FIELDS:
        if not _is_empty(config.get(field)):
            raise ValueError(f"{file}: {field}={config[field]!r} is not supported (only plain LoRA adapters are)")
    init = config.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise ValueError(
            f"{file}: init_lora_weights={init!r} is not supported: it changes the base model's weights (convert "
            f"the adapter to a plain LoRA when saving it: save_pretrained(path_initial_model_for_weight_conversion))"
        )


def _rank_and_scaling(file: Path, config: dict[str, Any], max_lora_rank: int) -> tuple[int, float]:
    """(r, the scaling of its deltas), with PEFT's defaults for absent fields."""
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{file}: r={rank!r} is not a positive integer")
    if rank > max_lora_rank:
        raise ValueError(f"{file}: r={rank} is above max_lora_rank={max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{file}: lora_alpha={alpha!r} is not a number")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora", False) else rank)


def _read_tensors(file: Path, data: bytes) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors file as float32 (numpy reads no bfloat16: the raw entries are viewed here)."""
    try:
        entries = safetensors.deserialize(data)
    except safetensors.SafetensorError as e:
        raise ValueError(f"{file}: cannot read safetensors file ({e})") from None
    tensors = {}
    for name, entry in entries:
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} is {entry['dtype']}, not a float type")
        tensors[name] = np.frombuffer(entry["data"], dtype).reshape(entry["shape"]).astype(np.float32)
    return tensors


def _module_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """transformers module → (in features, out features)."""
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _factors(file: Path, tensors: dict[str, np.ndarray], arch: ModelArch, rank: int) -> Factors:
    """Each (layer, module)'s lora_A and lora_B, their shapes checked; ValueError naming a tensor with no place."""
    shapes = _module_shapes(arch)
    found: dict[tuple[int, str, str], np.ndarray] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.search(name)
        if match is None or _PARENTS.get(match[3]) != match[2]:
            raise ValueError(
                f"{file}: tensor {name!r} cannot be placed: LoRA applies only to the lora_A/lora_B weights of "
                f"layers.N.self_attn.{{q,k,v,o}}_proj and layers.N.mlp.{{gate,up,down}}_proj"
            )
        layer, module, factor = int(match[1]), match[3], match[4]
        if layer >= arch.num_layers:
            raise ValueError(f"{file}: tensor {name!r} is for layer {layer}; the model has {arch.num_layers} layers")
        if (layer, module, factor) in found:
            raise ValueError(f"{file}: tensor {name!r} is a second lora_{factor} of layer {layer}'s {module}")
        fan_in, fan_out = shapes[module]
        expected = (rank, fan_in) if factor == "A" else (fan_out, rank)
        if tensor.shape != expected:
            raise ValueError(
                f"{file}: tensor {name!r} has shape {tensor.shape}, but {arch.architecture} with r={rank} needs "
                f"{expected}"
            )
        found[layer, module, factor] = tensor
    if not found:
        raise ValueError(f"{file}: no LoRA tensors")
    return {(layer, module): _pair(file, found, layer, module) for layer, module, _ in found}


def _pair(
    file: Path, found: dict[tuple[int, str, str], np.ndarray], layer: int, module: str
) -> tuple[np.ndarray, np.ndarray]:
    missing = [f"lora_{f}" for f in "AB" if (layer, module, f) not in found]
    if missing:
        raise ValueError(f"{file}: layer {layer}'s {module} has no {missing[0]} weight")
    return found[layer, module, "A"], found[layer, module, "B"]


def fused_shapes(arch: ModelArch) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Fused projection → (K, its output's shape), as the model's parameters have them (model/llama.py)."""
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    group = arch.num_heads // arch.num_kv_heads
    return {
        "qkv_proj": (h, (arch.num_kv_heads, group + 2, d)),
        "o_proj": (arch.num_heads * d, (h,)),
        "gate_up_proj": (h, (2, i)),
        "down_proj": (i, (h,)),
    }


def regions(arch: ModelArch) -> dict[str, tuple[slice, ...]]:
    """Where each module's output lies in its fused projection's output (weights/params.py fuses them so): per KV
    head j, its query heads j*G..j*G+G-1, then its key, then its value; gate, then up."""
    group, every = arch.num_heads // arch.num_kv_heads, slice(None)
    return {
        "q_proj": (every, slice(0, group)),
        "k_proj": (every, slice(group, group + 1)),
        "v_proj": (every, slice(group + 1, group + 2)),
        "o_proj": (),
        "gate_proj": (slice(0, 1),),
        "up_proj": (slice(1, 2),),
        "down_proj": (),
    }


def _fuse(
    name: str, factors: Factors, arch: ModelArch, rank: int, scaling: float, max_lora_rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """One fused projection's (A, B): part p's rank columns at p * max_lora_rank, zeros wherever nothing is."""
    fan_in, out_shape = fused_shapes(arch)[name]
    width = len(PROJECTIONS[name]) * max_lora_rank
    a = np.zeros((arch.num_layers, fan_in, width), np.float32)
    b = np.zeros((arch.num_layers, width, *out_shape), np.float32)
    where = regions(arch)
    for part, module in enumerate(PROJECTIONS[name]):
        start = part * max_lora_rank
        for layer in range(arch.num_layers):
            if (layer, module) not in factors:
                continue
            lora_a, lora_b = factors[layer, module]
            a[layer, :, start : start + rank] = lora_a.T
            index: tuple[int | slice, ...] = (layer, slice(start, start + rank), *where[module])
            rows = b[index]
            rows[...] = (lora_b.T * scaling).reshape(rows.shape)
    return a, b
