"""Layers read bottom-up: the simulator and the tuner are libraries the CLI calls, never the other way."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import jaxllm

LIBRARIES = ("sim", "tune")
ROOT = Path(jaxllm.__file__).parent


def library_modules() -> list[str]:
    return [
        f"jaxllm.{package}" + ("" if path.stem == "__init__" else f".{path.stem}")
        for package in LIBRARIES
        for path in sorted((ROOT / package).glob("*.py"))
    ]


def test_sim_and_tune_load_nothing_from_entrypoints():
    """Importing every module of jaxllm.sim and jaxllm.tune in a fresh interpreter loads no entrypoints module."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {library_modules()!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('jaxllm.entrypoints'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_sim_and_tune_name_no_entrypoints_import_even_inside_functions():
    """A deferred import would load the CLI only when called: no import statement in them names it."""
    found = []
    for package in LIBRARIES:
        for path in sorted((ROOT / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                found += [f"{path.name}: {n}" for n in names if n.startswith("jaxllm.entrypoints")]
    assert found == []
