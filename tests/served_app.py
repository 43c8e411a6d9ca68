"""An ASGI app (a fake instance, the router) under uvicorn on a thread of the test process, on a free port."""

import threading
import time

import uvicorn


class Served:
    def __init__(self, app, *, start_timeout: float = 30.0):
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="critical", lifespan="on", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.005)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
