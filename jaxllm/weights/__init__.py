"""Weight loading: one entry point, `load_model`, for every format jaxllm reads.

| what `model` names | format |
|---|---|
| None | the embedded default model (SmolLM2-135M-Instruct GGUF) |
| a `.gguf` file | GGUF: Q8_0/Q4_0/Q4_1 kept in their bits, other types dequantized on load |
| a folder with `jaxllm.json` | an Orbax checkpoint written by `jaxllm convert` |
| a folder with `config.json` | an HF model (safetensors) |
| `org/name` not on disk | an HF Hub repository, downloaded with `huggingface_hub` |

`quantization` (weights/quant/plan.py) decides which projections stay quantized, and how.
`load_format="dummy"` reads only the config (any of the above, or a `config.json` file)
and makes random weights. `open_model` reads only the config, so an engine can compile its
steps from `ModelSource.abstract_params` while `ModelSource.load` reads the weights.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from jaxllm.config import LOAD_FORMATS, resolve_dtype
from jaxllm.model.quant import QuantPlan
from jaxllm.model.registry import ModelArch, arch_from_hf_config, with_expert_parallel
from jaxllm.weights import converted, hf, orbax
from jaxllm.weights.default import DEFAULT_MODEL_NAME, default_model_path
from jaxllm.weights.mxfp4 import with_mxfp4_experts
from jaxllm.weights.params import (
    GetTensor,
    Layout,
    abstract_params,
    host_params_from_hf_tensors,
    param_shardings,
    params_from_hf_tensors,
    place,
    quantize_params,
)
from jaxllm.weights.quant.plan import make_plan

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    arch: ModelArch
    hf_config: dict
    params: Any
    tokenizer: Any  # a transformers tokenizer, or None when the source has none
    dtype: Any
    load_seconds: dict[str, float] = field(default_factory=dict)  # "weights", "tokenizer" (start-up report)
    laid_out: bool = False  # params already in the step's layout (`load(layout=...)`, where the loader applies it)
    quant: QuantPlan = field(default_factory=QuantPlan)  # the projections kept quantized


def _hub_name(name: str) -> bool:
    """Whether `name` reads as an HF Hub repository ("org/name") rather than a path."""
    return name.count("/") == 1 and not name.startswith((".", "/"))


def _resolve_source(model: str | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model == DEFAULT_MODEL_NAME:  # the embedded default (Q4_1 GGUF), by its name
        return default_model_path()
    if _hub_name(model):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt"]))
        except Exception as e:
            raise FileNotFoundError(f"model {model!r}: not a local path, and the Hub download failed ({e})") from None
    raise FileNotFoundError(f"model {model!r}: no such file or directory")


def _detect_format(path: Path) -> str:
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if orbax.is_checkpoint(path):
        return "orbax"
    if hf.is_hf_dir(path):
        return "hf"
    raise ValueError(f"{path}: not a model jaxllm can read (a .gguf file, an HF directory, or a jaxllm checkpoint)")


def _load_tokenizer(source: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source))
    except Exception as e:
        logger.warning("no tokenizer loaded from %s (%s); only token-id prompts will work", source, e)
        return None


@dataclass
class ModelSource:
    """A model whose config has been read but whose weights have not: enough to build and compile the
    steps (`abstract_params`) while `load` reads the weights, possibly in another thread."""

    name: str
    arch: ModelArch
    hf_config: dict
    dtype: Any
    path: Path
    format: str  # "gguf", "hf", "orbax", or "config" (a bare config.json, dummy weights only)
    dummy: bool
    gguf_file: Any = None
    quant: QuantPlan = field(default_factory=QuantPlan)

    def abstract_params(self, mesh: Mesh) -> Any:
        """The parameter tree as ShapeDtypeStructs carrying their shardings (what compiling needs)."""
        shapes, specs = abstract_params(self.arch, self.dtype, self.quant)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, param_shardings(specs, mesh)
        )

    def tokenizer(self, override: str | None = None):
        """The model's transformers tokenizer (a GGUF's built from its metadata), `override`'s if given, or None
        for a bare config."""
        if override is not None:  # asked for by name: a failure is an error, not a warning
            if not Path(override).expanduser().exists() and not _hub_name(override):
                raise FileNotFoundError(f"tokenizer {override!r}: no such file or directory")
            tokenizer = _load_tokenizer(override)
            if tokenizer is None:
                raise ValueError(f"tokenizer {override!r}: cannot be loaded (see the warning above)")
            return tokenizer
        if self.gguf_file is not None:
            return self.gguf_file.tokenizer()
        return None if self.format == "config" else _load_tokenizer(self.path)

    def load(
        self, mesh: Mesh, tokenizer: str | None = None, seed: int = 0, layout: Layout | None = None
    ) -> LoadedModel:
        """The weights, placed on `mesh` (and rearranged by `layout`), and the tokenizer (`tokenizer`
        overrides the model's own)."""
        started = time.perf_counter()
        arch, jdtype, path, quant = self.arch, self.dtype, self.path, self.quant
        shapes, specs = abstract_params(arch, jdtype, quant)
        laid_out = layout is not None  # the file loaders lay each layer out as they read it; the others below
        if self.dummy:
            from jaxllm.weights.dummy import dummy_params

            params = dummy_params(arch, jdtype, mesh, seed, quant, layout)  # each leaf laid out as it is drawn
        elif self.format == "gguf":  # converting takes seconds: later starts map what the first converted
            gguf = self.gguf_file
            params = converted.load_or_convert(
                path,
                arch,
                jdtype,
                shapes,
                param_shardings(specs, mesh),
                f"{layout.name if layout else ''}/{quant.describe()}",
                lambda allocate: host_params_from_hf_tensors(
                    arch, jdtype, gguf.tensor, str(path), layout, allocate, quant, gguf.blocks
                ),
            )  # laid out as it is converted
        elif self.format == "orbax":  # checkpoints hold float weights: quantized here when asked
            float_shapes, float_specs = abstract_params(arch, jdtype)
            params = orbax.restore_params(path, float_shapes, param_shardings(float_specs, mesh))
            if quant:
                params = place(quantize_params(params, quant), param_shardings(specs, mesh))
            laid_out = False
        else:
            reader: GetTensor = hf.SafetensorsReader(path)
            if (self.hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4":  # gpt-oss's
                reader = with_mxfp4_experts(reader, str(path))
            params = params_from_hf_tensors(arch, jdtype, reader, mesh, str(path), layout, quant)

        weights_loaded = time.perf_counter()
        tok = self.tokenizer(tokenizer)
        seconds = {"weights": weights_loaded - started, "tokenizer": time.perf_counter() - weights_loaded}
        return LoadedModel(
            name=self.name,
            arch=arch,
            hf_config=self.hf_config,
            params=params,
            tokenizer=tok,
            dtype=jdtype,
            load_seconds=seconds,
            laid_out=laid_out,
            quant=quant,
        )


def open_model(
    model: str | None = None,
    *,
    load_format: str = "auto",
    dtype: str = "auto",
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> ModelSource:
    """Find the model and read its config (a GGUF: its header), nothing more; decide what stays quantized
    (`quantization`, checked against the shapes and the tensor-parallel split before anything loads) and how a
    mixture of experts splits (`enable_expert_parallel`: whole experts over the tensor-parallel devices)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    jdtype = resolve_dtype(dtype)
    path = _resolve_source(model)
    name = DEFAULT_MODEL_NAME if model is None else str(model)
    dummy = load_format == "dummy"
    if path.is_file() and path.suffix == ".json":
        if not dummy:
            raise ValueError(f"{path}: a bare config file needs load_format='dummy'")
        fmt = "config"
    else:
        fmt = _detect_format(path)
        wanted = {"safetensors": "hf"}.get(load_format, load_format)
        if wanted not in ("auto", "dummy") and wanted != fmt:
            raise ValueError(f"{path}: load_format={load_format!r}, but this is a {fmt} model")

    gguf_file = None
    if fmt == "gguf":
        from jaxllm.weights.gguf import GGUFFile

        gguf_file = GGUFFile(path)
        hf_config = gguf_file.hf_config()
    else:
        hf_config = hf.read_config(path)
    arch = arch_from_hf_config(hf_config)
    if enable_expert_parallel:
        arch = with_expert_parallel(arch, tensor_parallel_size)
    gguf_types = gguf_file.tensor_types() if gguf_file is not None else None
    quant = make_plan(arch, quantization, gguf_types, tensor_parallel_size)
    return ModelSource(name, arch, hf_config, jdtype, path, fmt, dummy, gguf_file, quant)


def load_model(
    model: str | None = None,
    *,
    mesh: Mesh,
    load_format: str = "auto",
    dtype: str = "auto",
    tokenizer: str | None = None,
    seed: int = 0,
    quantization: str | None = None,
) -> LoadedModel:
    started = time.perf_counter()
    source = open_model(model, load_format=load_format, dtype=dtype, quantization=quantization)
    opened = time.perf_counter() - started
    loaded = source.load(mesh, tokenizer, seed)
    loaded.load_seconds["weights"] += opened
    return loaded
