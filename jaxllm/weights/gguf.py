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

import numpy as np

from jaxllm.weights.default import cache_dir
from jaxllm.weights.quant.gguf_blocks import QuantizedTensor, repack

logger = logging.getLogger(__name__)

# GGUF architecture → transformers architecture (Mistral GGUFs say "llama")
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED_QK = {"llama"}

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
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name_to_gguf(name: str) -> str:
    prefix, kind = name.rsplit(".", 1)
    for gguf_name, hf in _GLOBAL_TENSORS.items():
        if prefix == hf:
            return f"{gguf_name}.{kind}"
    parts = prefix.split(".")
    layer, module = parts[2], ".".join(parts[3:])
    inverse = {hf: g for g, hf in _LAYER_TENSORS.items()}
    return f"blk.{layer}.{inverse[module]}.{kind}"


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
        if md.get(f"{arch}.expert_count"):  # (a Mixtral GGUF says "llama")
            raise NotImplementedError(
                f"{self.path}: a mixture of experts ({md[f'{arch}.expert_count']} experts) in GGUF is not supported "
                f"yet; load the model's HF safetensors directory instead"
            )
        if "rope_freqs.weight" in self._tensors:
            raise NotImplementedError(f"{self.path}: GGUF rope frequency tensors (llama3 scaling) are not supported")

        def key(name, default=None):
            return md.get(f"{arch}.{name}", default)

        hidden, heads = key("embedding_length"), key("attention.head_count")
        config = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "model_type": arch,
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
            "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
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
        return config

    def tensor(self, hf_name: str) -> np.ndarray:
        """Dequantized float32 tensor in transformers' `[out, in]` layout."""
        name = self._name(hf_name)
        return self._unpermuted(name, _dequantize(self._raw(name), self._tensors[name].ggml_type))

    def blocks(self, hf_name: str) -> QuantizedTensor:
        """A Q8_0, Q4_0 or Q4_1 tensor in its bits (`gguf_blocks.repack`), rows as `tensor` orders them."""
        name = self._name(hf_name)
        qt = repack(self._raw(name), self._tensors[name].ggml_type)
        mins = None if qt.mins is None else self._unpermuted(name, qt.mins)
        rows = self._unpermuted(name, qt.qs), self._unpermuted(name, qt.scales)
        return QuantizedTensor(qt.format, qt.shape, *rows, mins)

    def tensor_types(self) -> dict[str, str]:
        """GGUF tensor name → GGML type name ("Q4_1", "F32", ...)."""
        import gguf

        return {name: gguf.GGMLQuantizationType(info.ggml_type).name for name, info in self._tensors.items()}

    def _name(self, hf_name: str) -> str:
        name = hf_name_to_gguf(hf_name)
        if name not in self._tensors:
            raise KeyError(f"{self.path}: tensor {name!r} (for {hf_name}) is missing")
        return name

    def _unpermuted(self, name: str, rows: np.ndarray) -> np.ndarray:
        """`rows` (a tensor's, `[out, ...]`) with llama.cpp's rotary interleaving of Q and K undone."""
        if self.gguf_architecture in PERMUTED_QK and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads_key = "attention.head_count" if name.split(".")[-2] == "attn_q" else "attention.head_count_kv"
            return unpermute_rows(rows, self.metadata[f"{self.gguf_architecture}.{heads_key}"])
        return rows

    def _raw(self, name: str) -> np.ndarray:
        """A tensor's bytes in the file, as `gguf.quants.dequantize` takes them: typed for float and integer
        types, `[..., bytes per row]` uint8 for block-quantized ones."""
        import gguf

        info = self._tensors[name]
        kind = gguf.GGMLQuantizationType(info.ggml_type)
        shape = tuple(reversed(info.dims))
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(shape)) * type_size // block
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
        start = self._data_offset + info.offset
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
