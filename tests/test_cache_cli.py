"""`jaxllm cache info|clear` and the bound on converted weights (issue 44, finding 9), on a temporary
$JAXLLM_CACHE: what is cached is listed with its size, clearing deletes only the kinds asked for, and the
least recently used conversions go once the bound is passed, never the one in use."""

import json
import logging
import os
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxllm.entrypoints.cli import main
from jaxllm.logger import FLOODS, QUIET_LIBRARIES
from jaxllm.weights import converted
from jaxllm.weights.default import FILE_IN_PACKAGE

MB = 1_000_000


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A temporary $JAXLLM_CACHE; `main` reconfigures logging, which is put back afterwards."""
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
    monkeypatch.delenv(converted.WEIGHTS_CACHE_GB_ENV, raising=False)
    for name in ("TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(converted, "_in_use", set())
    levels = {name: logging.getLogger(name).level for name in ["", *QUIET_LIBRARIES, *FLOODS]}
    yield tmp_path
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def write(path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)


def entry(cache, name: str, size: int, used: float, source: str = "model.gguf"):
    """A converted-weights folder of `size` bytes last used at `used` (a timestamp)."""
    folder = cache / "weights" / name
    write(folder / "layers.w.npy", size)
    (folder / converted.DESCRIPTION).write_text(json.dumps({"source": source, "dtype": "float32", "layout": name}))
    os.utime(folder, (used, used))
    return folder


def test_info_lists_each_kind_and_clear_deletes_what_is_asked(cache, capsys):
    now = time.time()
    entry(cache, "int8", 2 * MB, now - 60, source="/models/smol.gguf")
    write(cache / "tokenizers" / "t.json", 1 * MB)
    write(cache / "xla" / "jaxllm-executables" / "step.bin", 3 * MB)
    write(cache / "kernels" / "matmul.so", 4 * MB)
    write(cache / Path(FILE_IN_PACKAGE).name, 5 * MB)

    assert main(["cache", "info"]) == 0
    info = capsys.readouterr().out
    assert f"jaxllm cache: {cache}" in info
    lines = {line.split()[0]: line for line in info.splitlines() if line and not line.startswith(" ")}
    assert "3.0 MB" in lines["weights"] and "3.0 MB" in lines["compiled"] and "4.0 MB" in lines["kernels"]
    assert "5.0 MB" in lines["download"] and "15.0 MB" in lines["total"]
    assert "1 converted variants" in info and "/models/smol.gguf float32 int8" in info and "bound 8.0 GB" in info

    assert main(["cache", "clear", "--weights"]) == 0
    assert "cleared weights: 3.0 MB" in capsys.readouterr().out
    assert not (cache / "weights").exists() and not (cache / "tokenizers").exists()
    assert (cache / "xla").exists() and (cache / "kernels").exists()

    assert main(["cache", "clear", "--log-level", "WARNING"]) == 0  # no flag: every kind
    cleared = capsys.readouterr().out
    assert "cleared compiled: 3.0 MB" in cleared and "cleared kernels: 4.0 MB" in cleared
    assert not (cache / "xla").exists() and not (cache / "kernels").exists()
    assert (cache / Path(FILE_IN_PACKAGE).name).exists()  # a download, not a cache of ours


def test_the_bound_evicts_the_least_recently_used_but_never_one_in_use(cache, monkeypatch):
    now = time.time()
    oldest = entry(cache, "a", 3 * MB, now - 300)
    in_use = entry(cache, "b", 3 * MB, now - 200)
    newer = entry(cache, "c", 3 * MB, now - 100)
    abandoned = cache / "weights" / "x.partial"
    write(abandoned / "w.npy", MB)
    os.utime(abandoned, (now - 2 * converted.ABANDONED_S,) * 2)
    writing = cache / "weights" / "y.partial"  # another process converting now
    write(writing / "w.npy", MB)
    converted._in_use.add(in_use)
    monkeypatch.setenv(converted.WEIGHTS_CACHE_GB_ENV, "0.005")  # 5 MB: room for one of the three
    deleted = converted.evict()
    assert set(deleted) == {abandoned, oldest, newer}
    assert in_use.exists() and writing.exists()


def test_a_new_conversion_is_described_kept_and_bounds_the_others(cache, monkeypatch):
    """load_or_convert as the loader calls it, on a tiny tree: the new folder is kept (it is in use) and the
    older one goes; loading it again marks it used."""
    old = entry(cache, "old", 2 * MB, time.time() - 100)
    monkeypatch.setenv(converted.WEIGHTS_CACHE_GB_ENV, "0.001")  # 1 MB: less than either
    source = cache / "tiny.gguf"
    source.write_bytes(b"gguf")
    shapes = {"w": jax.ShapeDtypeStruct((4, 4), np.float32)}
    shardings = {"w": jax.sharding.SingleDeviceSharding(jax.devices()[0])}

    def convert(allocate):
        w = allocate(("w",), (4, 4), np.dtype(np.float32))
        w[...] = np.arange(16, dtype=np.float32).reshape(4, 4)
        return {"w": w}

    params = converted.load_or_convert(source, "arch", np.float32, shapes, shardings, "packed", convert)
    converted.wait_for_saves()
    [(folder, _, used, about)] = converted.entries()
    assert not old.exists()
    assert about == {"source": str(source), "dtype": "float32", "layout": "packed", "format": converted.FORMAT}
    os.utime(folder, (used - 100, used - 100))
    again = converted.load_or_convert(source, "arch", np.float32, shapes, shardings, "packed", convert)
    assert folder.stat().st_mtime > used - 50  # marked used
    np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(params["w"]))
