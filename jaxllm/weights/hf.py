"""HF model directories: `config.json`, `*.safetensors` (single or sharded with an index), tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_config(path: Path) -> dict:
    """`config.json`, its `eos_token_id` joined by `generation_config.json`'s: chat models often name their
    end-of-turn token only there (Gemma 2's `<end_of_turn>`, Llama 3's `<|eot_id|>`), and vLLM stops at both."""
    config_file = path / "config.json" if path.is_dir() else path
    config = _read_json(config_file, "an HF model directory needs config.json")
    generation_file = config_file.with_name("generation_config.json")
    if generation_file.is_file():
        eos = [*_ids(config.get("eos_token_id")), *_ids(_read_json(generation_file).get("eos_token_id"))]
        if eos:
            config["eos_token_id"] = list(dict.fromkeys(eos))
    return config


def _ids(value) -> list[int]:
    return [] if value is None else [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(file: Path, missing: str = "") -> dict:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{file}: no such file ({missing})" if missing else f"{file}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None


class SafetensorsReader:
    """Tensors of an HF directory by name, opened lazily across shards."""

    def __init__(self, path: Path):
        self.path = path
        self._handles: dict[Path, object] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files (jaxllm reads safetensors, not .bin)")
        index_file = path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            self._file_of = {name: path / fname for name, fname in weight_map.items()}
        else:
            self._file_of = {name: f for f in files for name in self._open(f).keys()}

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="flax")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{file}: cannot read safetensors file ({e})") from None
        return self._handles[file]

    def __call__(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"{self.path}: tensor {name!r} is missing from the safetensors files")
        try:
            return self._open(self._file_of[name]).get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{self._file_of[name]}: cannot read tensor {name!r} ({e})") from None
