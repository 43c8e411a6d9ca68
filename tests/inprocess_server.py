"""The OpenAI server on a thread of the test process, so tests can look inside its engine.
One instance serves every server test module (the `server` fixture in conftest.py)."""

import threading
import time

from jaxllm import EngineArgs
from jaxllm.bench.server_process import free_port
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.api_server import build_app
from jaxllm.entrypoints.openai.launcher import GracefulServer
from tests.conftest import TEST_ENGINE, TEST_KV_BLOCKS, kv_bytes

MODEL = "smol"


class InProcessServer:
    """uvicorn on a thread of the test process, so tests can look inside the engine."""

    def __init__(self, num_blocks: int = TEST_KV_BLOCKS, **engine_args):
        """`engine_args`: more EngineArgs (a pooling server: runner="pooling")."""
        import uvicorn

        args = {k: v for k, v in TEST_ENGINE.items() if k != "progress"} | engine_args
        self.engine = AsyncLLM(
            EngineArgs(**args, kv_cache_memory_bytes=kv_bytes(num_blocks)), served_model_name=MODEL, progress=False
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_app(self.engine, served_model_names=[MODEL])
        self.server = GracefulServer(
            uvicorn.Config(app, port=self.port, log_level="warning", lifespan="off"), self.engine
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    @property
    def core(self):
        return self.engine.client.core

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()
