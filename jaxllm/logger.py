"""Logging for the `jaxllm` command: jaxllm's own lines at the chosen level, other libraries' notices off.

Libraries print notices a user can do nothing about (transformers' "PyTorch was not found", httpx's
line per request, matplotlib's font cache): below DEBUG they are hidden; at DEBUG they are shown.
transformers configures its own handler when it is imported, from environment variables, so those
are set before anything imports it (and children such as calibrate's server inherit them).
"""

from __future__ import annotations

import logging
import os
import sys

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMAT = "%(levelname)s %(name)s: %(message)s"

# the least severe level each library still shows, below DEBUG
QUIET_LIBRARIES = {
    "transformers": logging.ERROR,
    "huggingface_hub": logging.ERROR,
    "matplotlib": logging.ERROR,
    "httpx": logging.WARNING,
    "httpcore": logging.WARNING,
    "urllib3": logging.WARNING,
    "filelock": logging.WARNING,
}
# libraries whose DEBUG lines would drown jaxllm's own, even at DEBUG
FLOODS = ("absl", "jax._src", "orbax")


def configure_logging(level: str) -> None:
    """The process's logging for the `jaxllm` command at `level` (one of LOG_LEVELS)."""
    debug = level == "DEBUG"
    if not debug:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.basicConfig(format=FORMAT, stream=sys.stderr)  # a no-op where a handler is already set (tests)
    logging.getLogger().setLevel(level)
    for name in FLOODS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, quiet in QUIET_LIBRARIES.items():
        logging.getLogger(name).setLevel(logging.INFO if debug else quiet)


def log_level_in(argv: list[str]) -> str | None:
    """The `--log-level` named anywhere in `argv` (before or after the subcommand), before parsing: what
    must be set up before the subcommands' modules import the libraries it quiets."""
    named = None
    for i, arg in enumerate(argv):
        if arg == "--log-level" and i + 1 < len(argv):
            named = argv[i + 1].upper()
        elif arg.startswith("--log-level="):
            named = arg.partition("=")[2].upper()
    return named if named in LOG_LEVELS else None
