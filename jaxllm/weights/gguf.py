"""GGUF files (llama.cpp's format): metadata → HF config, tensors dequantized on load, tokenizer.

The header (metadata and tensor table) is parsed here: the `gguf` package's reader builds a
numpy view per metadata item — ~150k of them for a 49k-token vocabulary, seconds at every
start. Tensors are memory-mapped, dequantized with the `gguf` package, and handed out under
their transformers names, so the model sees the same parameters as `transformers` loading
the same file. llama.cpp
stores the Q and K projections of Llama models with rows permuted for its interleaved
rotary convention; they are permuted back to the rotate-half layout here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxllm.weights.default import cache_dir
from jaxllm.weights.quant.gguf_blocks import QuantizedTensor, repack

logger = logging.getLogger(__name__)

# GGUF architecture → transformers architecture (Mistral GGUFs say "llama"; so do Mixtral's, with experts)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# transformers' spelling where it differs
MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
PERMUTED_QK = {"llama"}
# Whether the chosen experts' weights are renormalised: no GGUF key says so for these architectures, llama.cpp's
# graph fixes it per architecture (transformers patched the same defaults in, #41151); `expert_weights_norm`,
# where a file has it, decides instead
MOE_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
# MoE metadata jaxllm's router cannot honour: (key, the value it can)
MOE_UNSUPPORTED = {"expert_group_count": 0, "expert_gating_func": 1, "expert_weights_scale": 1.0}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # [H] in GGUF, [1, H] in transformers
}
# Gemma's four norms a layer: llama.cpp's `ffn_norm` is the norm before the MLP, not after attention
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
LAYER_TENSORS = {"gemma2": _GEMMA_LAYER_TENSORS, "gemma3": _GEMMA_LAYER_TENSORS}  # by GGUF architecture
# Gemma in llama.cpp: its converter stores RMSNorm weights as 1 + w (transformers keeps w); no key gives the layers'
# window pattern (every 2nd layer global in Gemma 2, every 6th in Gemma 3), Gemma 3's local RoPE base (10k) or the
# query scale (head_dim, but hidden / heads for the 27B models): llama.cpp fixes them per architecture and size
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_LOCAL_ROPE_BASE = 10000.0
# a layer's experts, every expert in one tensor `[E, out, in]`: transformers 5's fused names → GGUF's parts,
# joined along `out` (gate before up, as transformers fuses them)
_EXPERT_TENSORS = {
    "mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
    "mlp.experts.down_proj": ("ffn_down_exps",),
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name_to_gguf(name: str, architecture: str = "llama") -> list[str]:
    """The GGUF tensors behind a transformers tensor name in a GGUF of `architecture`: one, or a layer's expert
    parts (`_EXPERT_TENSORS`). KeyError for a name GGUF does not have (each expert's own tensors: GGUF keeps them
    fused)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's sparse block
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and (experts := ".".join(parts[3:])) in _EXPERT_TENSORS:
        return [f"blk.{parts[2]}.{part}.weight" for part in _EXPERT_TENSORS[experts]]
    prefix, kind = name.rsplit(".", 1)
    for gguf_name, hf in _GLOBAL_TENSORS.items():
        if prefix == hf:
            return [f"{gguf_name}.{kind}"]
    parts = prefix.split(".")
    layer, module = parts[2], ".".join(parts[3:])
    inverse = {hf: g for g, hf in LAYER_TENSORS.get(architecture, _LAYER_TENSORS).items()}
    return [f"blk.{layer}.{inverse[module]}.{kind}"]


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of rotary rows (`[out, ...]` layout)."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


DEQUANTIZE_ROWS = 128  # per call of the gguf package's row dequantizer (its own loop takes 16: 2-3x slower here)


def _dequantize(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """A tensor's float32 values from its bytes (`GGUFFile._raw`), by the gguf package's dequantizers."""
    import gguf

    kind = gguf.GGMLQuantizationType(ggml_type)
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    if block == 1:  # a plain float or integer type
        return gguf.quants.dequantize(raw, kind).astype(np.float32, copy=False)
    rows = raw.reshape(-1, raw.shape[-1])
    width = rows.shape[1] // type_size * block
    out = np.empty((rows.shape[0], width), np.float32)
    quant = getattr(gguf.quants, kind.name)
    for start in range(0, rows.shape[0], DEQUANTIZE_ROWS):
        out[start : start + DEQUANTIZE_ROWS] = quant.dequantize_rows(rows[start : start + DEQUANTIZE_ROWS]).reshape(
            -1, width
        )
    return out.reshape(*raw.shape[:-1], width)


TOKENIZER_CACHE_FORMAT = 1
MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: fixed-size scalars by struct format; 8 is a string, 9 an array
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    dims: tuple[int, ...]  # GGUF order: innermost first
    ggml_type: int
    offset: int  # from the start of the data section


class _HeaderParser:
    """Reads the header's little-endian values from a buffer, front to back."""

    def __init__(self, buffer):
        self.buffer, self.pos = buffer, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        if self.pos > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        return str(self.buffer[self.pos - n : self.pos], "utf-8")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, n = self.scalar("<I"), self.scalar("<Q")
            if item_kind in _SCALAR_FORMATS:  # one vectorized read (token scores, types…)
                dtype = np.dtype(_SCALAR_FORMATS[item_kind].replace("?", "b1"))
                values = np.frombuffer(self.buffer, dtype, n, self.pos)
                self.pos += values.nbytes
                return values.tolist()
            return [self.value(item_kind) for _ in range(n)]
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.scalar(_SCALAR_FORMATS[kind])


def read_header(buffer) -> tuple[dict, dict[str, TensorInfo], int]:
    """(metadata, tensor table by GGUF name, offset of the data section) of a GGUF v2/v3 file."""
    parser = _HeaderParser(buffer)
    if bytes(buffer[:4]) != MAGIC:
        raise ValueError("no GGUF magic")
    parser.pos = 4
    version = parser.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (jaxllm reads 2 and 3)")
    n_tensors, n_metadata = parser.scalar("<Q"), parser.scalar("<Q")
    metadata = {}
    for _ in range(n_metadata):
        key = parser.string()
        metadata[key] = parser.value(parser.scalar("<I"))
    tensors = {}
    for _ in range(n_tensors):
        name = parser.string()
        dims = tuple(parser.scalar("<Q") for _ in range(parser.scalar("<I")))
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        tensors[name] = TensorInfo(dims, parser.scalar("<I"), parser.scalar("<Q"))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    return metadata, tensors, -(-parser.pos // alignment) * alignment


class GGUFFile:
    """One GGUF file: metadata, an HF-style config, the tokenizer, and tensors by transformers name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        try:
            with open(self.path, "rb") as f:
                self._buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.metadata, self._tensors, self._data_offset = read_header(self._buffer)
        except Exception as e:  # bad bytes raise ValueError, struct.error, UnicodeDecodeError…
            raise ValueError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

    @property
    def gguf_architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def hf_config(self) -> dict:
        md, arch = self.metadata, self.gguf_architecture
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: unsupported GGUF architecture {arch!r}; jaxllm reads {', '.join(GGUF_ARCHITECTURES)}"
            )
        if "rope_freqs.weight" in self._tensors:
            raise NotImplementedError(f"{self.path}: GGUF rope frequency tensors (llama3 scaling) are not supported")

        def key(name, default=None):
            return md.get(f"{arch}.{name}", default)

        hidden, heads = key("embedding_length"), key("attention.head_count")
        config = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "model_type": MODEL_TYPES.get(arch, arch),
            "vocab_size": key("vocab_size") or len(md["tokenizer.ggml.tokens"]),
            "hidden_size": hidden,
            "intermediate_size": key("feed_forward_length"),
            "num_hidden_layers": key("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": key("attention.head_count_kv", heads),
            "head_dim": key("attention.key_length", hidden // heads),
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
            "max_position_embeddings": key("context_length", 2048),
            "rope_theta": key("rope.freq_base", 10000.0),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "hidden_act": "silu",
            "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
            # llama.cpp stops at the end-of-turn token too (Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>`)
            "eos_token_id": [
                md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if md.get(k) is not None
            ],
        }
        scaling = key("rope.scaling.type")
        if scaling and scaling != "none":
            config["rope_scaling"] = {
                "rope_type": scaling,
                "factor": key("rope.scaling.factor", 1.0),
                "original_max_position_embeddings": key("rope.scaling.original_context_length"),
            }
        if (window := key("attention.sliding_window")) is not None:
            config["sliding_window"] = window
        if key("expert_count"):
            config.update(self._moe_config())
        if arch in GEMMA_SWA_PATTERN:
            config.update(self._gemma_config())
        return config

    def _gemma_config(self) -> dict:
        """Gemma 2/3's config fields from llama.cpp's metadata, and its per-architecture defaults where none."""
        arch = self.gguf_architecture

        def key(name: str, default: Any = None) -> Any:
            return self.metadata.get(f"{arch}.{name}", default)

        layers, hidden, heads = key("block_count"), key("embedding_length"), key("attention.head_count")
        pattern = int(key("attention.sliding_window_pattern") or GEMMA_SWA_PATTERN[arch])
        config = {
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)],
            "query_pre_attn_scalar": hidden // heads
            if layers == GEMMA_27B_LAYERS[arch]
            else key("attention.key_length", hidden // heads),
            "attn_logit_softcapping": key("attn_logit_softcapping"),
            "final_logit_softcapping": key("final_logit_softcapping"),
        }
        if arch == "gemma3":
            config["rope_local_base_freq"] = GEMMA_LOCAL_ROPE_BASE
        return config

    def _moe_config(self) -> dict:
        """A mixture of experts' config fields, as transformers names them, from llama.cpp's metadata."""
        md, arch = self.metadata, self.gguf_architecture

        def key(name: str, default: Any = None) -> Any:
            return md.get(f"{arch}.{name}", default)

        if arch not in MOE_NORM_TOPK:
            raise NotImplementedError(f"{self.path}: a mixture of experts in GGUF architecture {arch!r}")
        for name, honoured in MOE_UNSUPPORTED.items():
            if key(name, honoured) != honoured:
                raise NotImplementedError(
                    f"{self.path}: {arch}.{name} = {key(name)} (jaxllm's router takes {honoured}) is not supported"
                )
        experts, used, ff = (int(key(k) or 0) for k in ("expert_count", "expert_used_count", "feed_forward_length"))
        if not used:
            raise ValueError(f"{self.path}: {arch}.expert_count is set but {arch}.expert_used_count is not")
        # llama.cpp's own fallbacks: Qwen2-MoE's experts are n_ff / k wide and its shared expert n_ff without keys
        expert_ff = key("expert_feed_forward_length") or (ff // used if arch == "qwen2moe" else ff)
        config = {
            "num_experts": experts,
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "moe_intermediate_size": expert_ff,
            "norm_topk_prob": bool(key("expert_weights_norm", MOE_NORM_TOPK[arch])),
            # layers without a router are dense (llama.cpp requires one in every layer; read, not assumed)
            "mlp_only_layers": [
                i for i in range(int(key("block_count", 0))) if f"blk.{i}.ffn_gate_inp.weight" not in self._tensors
            ],
        }
        if arch == "llama":
            config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=expert_ff)
        if arch == "qwen2moe":
            config["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length") or ff
        return config

    def tensor(self, hf_name: str) -> np.ndarray:
        """Dequantized float32 tensor in transformers' layout (`[out, in]`; a layer's experts `[E, out, in]`)."""
        names = self._names(hf_name)
        values = [self._unpermuted(n, _dequantize(self._raw(n), self._tensors[n].ggml_type)) for n in names]
        value = values[0] if len(values) == 1 else np.concatenate(values, axis=-2)
        self._release(names)
        if self.gguf_architecture in GEMMA_SWA_PATTERN and names[0].endswith("norm.weight"):
            return value - 1.0  # stored as 1 + w (`GEMMA_SWA_PATTERN`'s comment)
        return value[None] if names[0].endswith(".ffn_gate_inp_shexp.weight") else value

    def blocks(self, hf_name: str) -> QuantizedTensor:
        """A Q8_0, Q4_0 or Q4_1 tensor in its bits (`gguf_blocks.repack`), rows as `tensor` orders them (a
        layer's experts: `[E * out]` rows, each expert's parts joined)."""
        names = self._names(hf_name)
        parts = [self._blocks(name) for name in names]
        self._release(names)
        if len(parts) == 1:
            return parts[0]
        experts = self._tensors[names[0]].dims[2]  # [in, out, E], innermost first

        def joined(arrays):  # each part's [E * out, ...] rows → [E * (out + out'), ...], expert by expert
            split = [a.reshape(experts, -1, a.shape[-1]) for a in arrays]
            return np.concatenate(split, axis=1).reshape(-1, arrays[0].shape[-1])

        first, rows = parts[0], sum(p.shape[0] for p in parts)
        mins = None if first.mins is None else joined([p.mins for p in parts])
        qs, scales = joined([p.qs for p in parts]), joined([p.scales for p in parts])
        return QuantizedTensor(first.format, (rows, first.shape[1]), qs, scales, mins)

    def _blocks(self, name: str) -> QuantizedTensor:
        qt = repack(self._raw(name), self._tensors[name].ggml_type)
        mins = None if qt.mins is None else self._unpermuted(name, qt.mins)
        return QuantizedTensor(
            qt.format, qt.shape, self._unpermuted(name, qt.qs), self._unpermuted(name, qt.scales), mins
        )

    def tensor_types(self) -> dict[str, str]:
        """GGUF tensor name → GGML type name ("Q4_1", "F32", ...)."""
        import gguf

        return {name: gguf.GGMLQuantizationType(info.ggml_type).name for name, info in self._tensors.items()}

    def _names(self, hf_name: str) -> list[str]:
        names = hf_name_to_gguf(hf_name, self.gguf_architecture)
        for name in names:
            if name not in self._tensors:
                raise KeyError(f"{self.path}: tensor {name!r} (for {hf_name}) is missing")
        return names

    def _unpermuted(self, name: str, rows: np.ndarray) -> np.ndarray:
        """`rows` (a tensor's, `[out, ...]`) with llama.cpp's rotary interleaving of Q and K undone."""
        if self.gguf_architecture in PERMUTED_QK and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads_key = "attention.head_count" if name.split(".")[-2] == "attn_q" else "attention.head_count_kv"
            return unpermute_rows(rows, self.metadata[f"{self.gguf_architecture}.{heads_key}"])
        return rows

    def _span(self, name: str) -> tuple[int, int]:
        """(offset in the file, bytes) of a tensor's data."""
        import gguf

        info = self._tensors[name]
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
        return self._data_offset + info.offset, int(np.prod(info.dims)) * type_size // block

    def _release(self, names: list[str]) -> None:
        """Drop the tensors' pages from this process's resident memory once read (they stay in the page cache and
        fault back in if read again): a conversion reads each tensor once, and a mapped 4 GB file would otherwise
        count whole in the start's peak RSS, beside the converted copy."""
        for name in names:
            start, nbytes = self._span(name)
            if nbytes == 0 or start >= len(self._buffer):
                continue
            first = start - start % mmap.PAGESIZE
            self._buffer.madvise(mmap.MADV_DONTNEED, first, min(start + nbytes, len(self._buffer)) - first)

    def _raw(self, name: str) -> np.ndarray:
        """A tensor's bytes in the file, as `gguf.quants.dequantize` takes them: typed for float and integer
        types, `[..., bytes per row]` uint8 for block-quantized ones."""
        import gguf

        info = self._tensors[name]
        kind = gguf.GGMLQuantizationType(info.ggml_type)
        shape = tuple(reversed(info.dims))
        plain = {
            "F16": np.float16,
            "F32": np.float32,
            "F64": np.float64,
            "I8": np.int8,
            "I16": np.int16,
            "I32": np.int32,
            "I64": np.int64,
        }.get(kind.name)
        dtype, shape = (plain, shape) if plain else (np.uint8, gguf.quant_shape_to_byte_shape(shape, kind))
        start, nbytes = self._span(name)
        if start + nbytes > len(self._buffer):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
        return np.frombuffer(self._buffer, dtype, nbytes // np.dtype(dtype).itemsize, start).reshape(shape)

    def tokenizer(self):
        """The tokenizer and chat template stored in the file, built without torch.

        transformers' own GGUF reader imports torch; its tokenizer converter does not, so the
        metadata is read here and handed to that converter. Converting costs seconds at every
        start (importing the converter scans every transformers model package), so the result
        is kept in jaxllm's cache folder, keyed by the file and the library versions.
        """
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        if "tokenizer.ggml.model" not in self.metadata:  # as an HF directory without one
            logger.warning("%s holds no tokenizer; only token-id prompts will work", self.path)
            return None
        cached = self._tokenizer_cache_path()
        try:
            saved = json.loads(cached.read_text())
            return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(saved["tokenizer"]), **saved["kwargs"])
        except (OSError, ValueError, KeyError, TypeError):  # absent or unreadable: convert again
            pass
        logger.info("converting the tokenizer of %s: first use, ~1-3 s; kept in %s", self.path.name, cached.parent)
        backend, kwargs = self._convert_tokenizer()
        try:
            text = json.dumps({"tokenizer": backend.to_str(), "kwargs": kwargs})
            cached.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=cached.parent, suffix=".partial", delete=False) as f:
                f.write(text)
            os.replace(f.name, cached)
        except (OSError, TypeError) as e:  # a read-only cache or a setting JSON cannot hold: convert every time
            logger.debug("tokenizer of %s not cached: %s", self.path, e)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)

    def _tokenizer_cache_path(self) -> Path:
        import tokenizers
        import transformers

        stat = self.path.stat()
        key = hashlib.sha256(
            repr(
                (
                    str(self.path.resolve()),
                    stat.st_size,
                    stat.st_mtime_ns,
                    transformers.__version__,
                    tokenizers.__version__,
                    TOKENIZER_CACHE_FORMAT,
                )
            ).encode()
        ).hexdigest()[:32]
        return cache_dir() / "tokenizers" / f"{key}.json"

    def _convert_tokenizer(self):
        """(a `tokenizers.Tokenizer`, the `PreTrainedTokenizerFast` settings) from the file's metadata."""
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        md = self.metadata
        grouped = {
            group: {new: md[f"tokenizer.{old}"] for old, new in names.items() if f"tokenizer.{old}" in md}
            for group, names in GGUF_TOKENIZER_MAPPING.items()
        }
        tokens, config = grouped["tokenizer"], grouped["tokenizer_config"]
        if tokens.get("tokenizer_type") == "llama":
            config.setdefault("add_bos_token", True)
        for special, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        ):
            token_id = md.get(f"tokenizer.ggml.{key}")
            config[special] = tokens["tokens"][token_id] if token_id is not None else None
        backend, extra = convert_gguf_tokenizer(self.gguf_architecture, tokens)
        return backend, {**config, **extra}
