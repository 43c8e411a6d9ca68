"""The `jaxllm` command is quiet by default and fails fast (issue 44, findings 4 and 6): other libraries'
notices only at DEBUG, `--log-level` before or after the subcommand, a port in use refused before loading."""

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from jaxllm.entrypoints.cli import build_parser
from jaxllm.logger import FLOODS, QUIET_LIBRARIES, configure_logging

NOTICE = "PyTorch was not found"
# `jaxllm ...` where transformers finds no PyTorch, as on a fresh install without the test extra
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; from jaxllm.entrypoints.cli import main; sys.exit(main())"


TRANSFORMERS_ENV = ("TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS")


def jaxllm(*args, timeout=120):
    """The command as a user runs it: without what an in-process `main` of another test left in os.environ."""
    env = {k: v for k, v in os.environ.items() if k not in TRANSFORMERS_ENV}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture
def restore_logging(monkeypatch):
    """configure_logging changes the process's loggers and environment: put them back after the test."""
    for name in TRANSFORMERS_ENV:
        monkeypatch.setenv(name, "")  # so that monkeypatch restores it (or its absence) afterwards
        monkeypatch.delenv(name)
    names = ["", *QUIET_LIBRARIES, *FLOODS]
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_log_level_is_accepted_after_the_subcommand():
    parse = build_parser().parse_args
    assert parse(["generate", "hi"]).log_level == "INFO"
    assert parse(["--log-level", "WARNING", "generate", "hi"]).log_level == "WARNING"
    assert parse(["generate", "--log-level", "WARNING", "hi"]).log_level == "WARNING"  # the command
    assert parse(["--log-level", "ERROR", "serve", "--log-level", "debug"]).log_level == "DEBUG"
    assert parse(["bench", "latency", "--log-level", "WARNING"]).log_level == "WARNING"
    assert parse(["cache", "info", "--log-level", "ERROR"]).log_level == "ERROR"


def test_other_libraries_are_quiet_unless_debug(restore_logging):
    configure_logging("INFO")
    assert logging.getLogger("jaxllm").isEnabledFor(logging.INFO)
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)  # the router's line per request
    assert not logging.getLogger("matplotlib.font_manager").isEnabledFor(logging.WARNING)  # the font cache line
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"
    configure_logging("DEBUG")
    assert logging.getLogger("httpx").isEnabledFor(logging.INFO)
    assert logging.getLogger("matplotlib.font_manager").isEnabledFor(logging.WARNING)


def test_transformers_notice_only_at_debug(tmp_path):
    """The issue's `[transformers] PyTorch was not found...` on a command that loads the tokenizer."""
    quiet = jaxllm("convert", "--tokenizer-only", "--out", str(tmp_path / "a"))
    assert quiet.returncode == 0, quiet.stderr
    assert NOTICE not in quiet.stderr + quiet.stdout
    shown = jaxllm("convert", "--log-level", "DEBUG", "--tokenizer-only", "--out", str(tmp_path / "b"))
    assert shown.returncode == 0, shown.stderr
    assert NOTICE in shown.stderr  # asked for: --log-level after the subcommand works


@pytest.mark.parametrize(
    "command", [["serve"], ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]]
)
def test_a_port_in_use_fails_in_one_line_before_loading(command):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = jaxllm(*command, "--port", str(port), timeout=60)
        elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    error = f"jaxllm {command[0]}: error: cannot listen on 127.0.0.1:{port}: the address is already in use"
    assert result.stderr.startswith(error) and len(result.stderr.splitlines()) == 1, result.stderr
    assert elapsed < 8  # the model loads in ~10 s (the 9.7 s); importing and binding takes ~1 s


def test_the_router_serves_on_the_socket_it_bound_first():
    """The bound socket is the one served: the address line users wait for, an answer, Ctrl-C exits 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", str(port)]
    process = subprocess.Popen(
        [sys.executable, "-c", WITHOUT_TORCH, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lines = []
        while not any(f"Uvicorn running on http://127.0.0.1:{port}" in line for line in lines):
            line = process.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503  # no instance answers
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
