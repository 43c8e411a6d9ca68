"""Request logging, as vLLM's: off unless `jaxllm serve --enable-log-requests`, since a prompt is the
user's data; `--max-log-len` cuts each logged prompt (characters) and its token ids."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("jaxllm.server")


class RequestLogger:
    def __init__(self, *, max_log_len: int | None = None):
        if max_log_len is not None and max_log_len < 0:
            raise ValueError(f"--max-log-len must be 0 or more, got {max_log_len}")
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: Any) -> None:
        """One INFO line: the request's prompt, its token ids and its sampling parameters."""
        if not logger.isEnabledFor(logging.INFO):
            return
        if self.max_log_len is not None:
            prompt = prompt[: self.max_log_len] if prompt is not None else None
            prompt_token_ids = prompt_token_ids[: self.max_log_len] if prompt_token_ids is not None else None
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
            request_id,
            prompt,
            params,
            prompt_token_ids,
        )
