"""Run the app under uvicorn with a shutdown that suits an inference engine."""

from __future__ import annotations

import uvicorn

from jaxllm.engine.async_llm import AsyncLLM


class GracefulServer(uvicorn.Server):
    """uvicorn's server with two changes.

    - Shutdown first aborts every request in flight, so streams end within a step or two
      (finish_reason "abort") instead of running on to max_tokens, and new requests get a 503.
    - A SIGINT/SIGTERM it handled is not re-raised after shutdown: the process exits 0.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        self.engine.stop_accepting("the server is shutting down")
        self.engine.abort_all()
        await super().shutdown(sockets)


def serve_http(
    app, engine: AsyncLLM, *, host: str, port: int, log_level: str = "info", timeout_graceful_shutdown: float = 5.0
) -> None:
    """Serve until SIGINT/SIGTERM (blocks); the engine is shut down on the way out."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        # uvicorn types it int, but waits with asyncio.timeout, which takes a float
        timeout_graceful_shutdown=timeout_graceful_shutdown,  # type: ignore[arg-type]
    )
    try:
        GracefulServer(config, engine).run()
    finally:
        engine.shutdown()
