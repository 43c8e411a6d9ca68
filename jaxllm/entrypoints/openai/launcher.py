"""Run the app under uvicorn with a shutdown that suits an inference engine, on a socket bound before
the engine is built (`create_server_socket`): a port in use is an error before minutes of loading."""

from __future__ import annotations

import errno
import logging
import socket
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:  # not imported at run time: the router uses this module without an engine
    from jaxllm.engine.async_llm import AsyncLLM


def create_server_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not listening yet, as vLLM creates it before the engine: clients
    are refused until the server starts. A ValueError (one line from the CLI) when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may bind while old connections close
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"cannot listen on {host}:{port}: the address is already in use (--host, --port)"
            ) from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (--host, --port)") from None
    return sock


class BoundServer(uvicorn.Server):
    """uvicorn's server, saying where it listens also when given a bound socket (uvicorn says it only when it
    binds one itself): `Uvicorn running on http://HOST:PORT`, the line users and tests wait for."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if sockets and not self.should_exit:
            for sock in sockets:
                host, port = sock.getsockname()[:2]
                address = f"[{host}]" if ":" in host else host
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", address, port
                )


class GracefulServer(BoundServer):
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
    app,
    engine: AsyncLLM,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    timeout_graceful_shutdown: float = 5.0,
    sock: socket.socket | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (blocks); the engine is shut down on the way out. `sock`: bound by
    `create_server_socket` (else uvicorn binds host:port itself)."""
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
        GracefulServer(config, engine).run(sockets=[sock] if sock is not None else None)
    finally:
        engine.shutdown()
