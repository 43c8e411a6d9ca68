"""What the server logs about requests (issue 44, findings 7 and 8): nothing by default, vLLM's line per
request with `--enable-log-requests` (prompts cut to `--max-log-len`), and a warning naming the fields a
request carried that nothing reads. On the shared in-process server (the `server` fixture)."""

import logging

import httpx

from jaxllm.entrypoints.cli import build_parser
from jaxllm.entrypoints.logger import RequestLogger
from jaxllm.entrypoints.openai.api_server import build_app
from tests.inprocess_server import MODEL

PROMPT = "The capital of France is"
RECEIVED = "Received request"


def complete(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **fields}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_requests_are_not_logged_by_default(server, caplog):
    assert build_parser().parse_args(["serve"]).enable_log_requests is False
    with caplog.at_level(logging.DEBUG, logger="jaxllm"):
        assert complete(server).status_code == 200
    assert not [r for r in caplog.records if RECEIVED in r.getMessage() or PROMPT in r.getMessage()]


def test_enable_log_requests_logs_each_prompt_cut_to_max_log_len(server, caplog):
    args = build_parser().parse_args(["serve", "--enable-log-requests", "--max-log-len", "10"])
    app = build_app(server.engine, enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len)
    assert app.state.openai_serving_completion.request_logger.max_log_len == 10  # the flags reach the routes
    serving = server.server.config.app.state.openai_serving_completion  # the running server's, for one request
    serving.request_logger = RequestLogger(max_log_len=args.max_log_len)
    try:
        with caplog.at_level(logging.INFO, logger="jaxllm.server"):
            assert complete(server).status_code == 200
    finally:
        serving.request_logger = None
    [line] = [r.getMessage() for r in caplog.records if RECEIVED in r.getMessage()]
    assert f"prompt: {PROMPT[:10]!r}," in line and PROMPT not in line
    assert "params: SamplingParams(" in line and "max_tokens=2," in line


def test_unknown_request_fields_are_named_in_one_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxllm.server"):
        assert complete(server, temprature=0.5).status_code == 200  # ignored, not refused, as vLLM
        assert complete(server).status_code == 200
    [warning] = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert "The following fields were present in the request but ignored: ['temprature']" in warning.getMessage()
