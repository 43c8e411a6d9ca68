"""`jaxllm cache info|clear`: what jaxllm keeps on disk under `$JAXLLM_CACHE`, and deleting it.

Three kinds, each rebuilt by the next start that needs it (docs/startup.md): `weights` (GGUF weights and
tokenizers converted for this machine's layout), `compiled` (the compiled steps and JAX's compilation
cache), `kernels` (the C++ CPU kernels and their self-check's choices). The default model's downloaded
GGUF file is listed, never cleared: it is a download, not something derived.
"""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

KINDS = ("weights", "compiled", "kernels")


def register(sub) -> None:
    cache = sub.add_parser("cache", help="show or clear what jaxllm keeps on disk ($JAXLLM_CACHE)")
    actions = cache.add_subparsers(dest="action", required=True, parser_class=type(cache))
    info = actions.add_parser("info", help="what is cached, where, and its size")
    info.set_defaults(func=run_info)
    clear = actions.add_parser("clear", help="delete cached files (no flag: weights, compiled and kernels)")
    clear.add_argument("--weights", action="store_true", help="converted weights and tokenizers")
    clear.add_argument("--compiled", action="store_true", help="compiled steps and JAX's compilation cache")
    clear.add_argument("--kernels", action="store_true", help="the C++ CPU kernels and their self-check's choices")
    clear.set_defaults(func=run_clear)


def folders() -> dict[str, list[Path]]:
    """Each kind's folders. (`compiled`: the default `--compilation-cache-dir`; another one is the user's.)"""
    from jaxllm.weights.default import cache_dir

    root = cache_dir()
    return {
        "weights": [root / "weights", root / "tokenizers"],
        "compiled": [root / "xla"],
        "kernels": [root / "kernels"],
    }


def file_count(folder: Path) -> int:
    return sum(len(files) for _, _, files in _walk(folder))


def _walk(folder: Path):
    import os

    return os.walk(folder) if folder.is_dir() else iter(())


def human(size: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def run_info(args) -> None:
    from jaxllm.weights import converted
    from jaxllm.weights.default import FILE_IN_PACKAGE, cache_dir

    bound = converted.bound_bytes()  # a bad $JAXLLM_WEIGHTS_CACHE_GB: the error before any output
    print(f"jaxllm cache: {cache_dir()} ($JAXLLM_CACHE)")
    total = 0
    for kind, paths in folders().items():
        size = sum(converted.folder_size(p) for p in paths)
        total += size
        where = ", ".join(f"{p.name}/ ({file_count(p)} files)" for p in paths)
        print(f"{kind:<9} {human(size):>9}  {where}")
        if kind == "weights":
            kept = converted.entries()
            print(
                f"  {len(kept)} converted variants, least recently used first (bound {human(bound)}: "
                f"${converted.WEIGHTS_CACHE_GB_ENV})"
            )
            for folder, entry_size, used, about in kept:
                when = datetime.datetime.fromtimestamp(used).strftime("%Y-%m-%d %H:%M")
                what = (
                    " ".join(str(about[k]) for k in ("source", "dtype", "layout") if about.get(k)) or "(no description)"
                )
                print(f"  {human(entry_size):>9}  used {when}  {folder.name}  {what}")
    download = cache_dir() / Path(FILE_IN_PACKAGE).name
    if download.is_file():
        size = download.stat().st_size
        total += size
        print(f"{'download':<9} {human(size):>9}  {download.name} (the default model; not cleared)")
    print(f"{'total':<9} {human(total):>9}")


def run_clear(args) -> None:
    from jaxllm.weights import converted

    chosen = [kind for kind in KINDS if getattr(args, kind)] or list(KINDS)
    for kind in chosen:
        paths = folders()[kind]
        size = sum(converted.folder_size(p) for p in paths)
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        left = [p for p in paths if p.exists()]
        if left:
            raise ValueError(f"could not delete {', '.join(map(str, left))}")
        print(f"cleared {kind}: {human(size)} ({', '.join(map(str, paths))})")
