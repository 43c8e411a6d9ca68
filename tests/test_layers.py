"""Layers read bottom-up: the simulator and the tuner are libraries the CLI calls, never the other way."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import jaxllm

LIBRARIES = ("sim", "tune", "routing", "kv_events")  # (routing and KV events: the simulator will drive them)
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


def imports_of(path: Path) -> list[str]:
    """Every module an `import` statement in `path` names, at module level or inside a function."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return names


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circle_in_jaxllm():
    """Modules (and the packages a module's import runs) form no cycle, deferred imports included."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in imports_of(path):
            parts = target.split(".")
            for k in range(2, len(parts) + 1):  # importing a.b.c runs a.b's __init__ too
                named = ".".join(parts[:k])
                if named in modules and named != name and not name.startswith(named + "."):
                    graph[name].add(named)
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        seen[name] = 1
        for target in sorted(graph[name]):
            assert seen.get(target) != 1, "import circle: " + " -> ".join([*path[path.index(target) :], target])
            if target not in seen:
                visit(target, [*path, target])
        seen[name] = 2

    for name in sorted(graph):
        if name not in seen:
            visit(name, [name])


def test_config_imports_no_feature_code():
    """Configs are read by every layer: importing them loads no model, kernel, connector or drafter code."""
    configs = [module_name(p) for p in sorted((ROOT / "config").glob("*.py"))]
    code = (
        "import importlib, json, sys\n"
        f"for name in {configs!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'pallas_kernels')\n"
        "    or m.startswith(('jaxllm.kv_transfer', 'jaxllm.spec_decode', 'jaxllm.model', 'jaxllm.runner',\n"
        "                     'jaxllm.weights', 'jaxllm.structured')))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_the_device_side_reads_the_step_contract_not_the_scheduler():
    """runner/ imports nothing from engine/, and the step broadcast and a draft model's runner reach the scheduler's
    data through the contract (scheduler_output.py, request.py) alone."""
    found = []
    for package, banned in (("runner", "jaxllm.engine"), ("distributed", "jaxllm.engine.scheduler")):
        for path in sorted((ROOT / package).glob("*.py")):
            found += [f"{package}/{path.name}: {n}" for n in imports_of(path) if n.startswith(banned)]
    found += [n for n in imports_of(ROOT / "spec_decode" / "draft_model.py") if n.startswith("jaxllm.engine.scheduler")]
    assert found == []
