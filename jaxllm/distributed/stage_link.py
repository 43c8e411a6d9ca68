"""Arrays between processes with JAX's own transport (`jax.experimental.transfer`): pipeline stages on other hosts.

Each process starts one transfer server and publishes its address in jax.distributed's key-value store; a
process offers a step's arrays under the step's number (`offer`, held until pulled or `timeout` passes) and the
process that needs them pulls them by that number (`pull`: a pull may come before the offer, it then waits for
it). Nothing here blocks without a deadline: `wait` polls the pulled arrays and ends the process with one line
(as a lost collective does) when they are not there in time.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

import jax

from jaxllm.distributed.watchdog import die

KEY = "jaxllm/transfer-server/{}"


def start_transfer_server(host: str):
    """This process's transfer server, listening on `host` (any free port)."""
    from jax.experimental import transfer

    return transfer.start_transfer_server(jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"])


def reachable_host(peer: str) -> str:
    """The address of this machine that packets to `peer` ("host:port") leave from: what the others can reach."""
    host, _, port = peer.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port or 1)))  # UDP: no packet is sent
        return s.getsockname()[0]


class StageLink:
    def __init__(self, timeout: float):
        from jax._src import distributed

        state = distributed.global_state
        if state.client is None or state.coordinator_address is None:
            raise RuntimeError("jax.distributed is not initialized")
        self.timeout = timeout
        self.rank = jax.process_index()
        self.server = start_transfer_server(reachable_host(state.coordinator_address))
        self._store = state.client
        self._store.key_value_set(KEY.format(self.rank), self.server.address())
        self._connections: dict[int, Any] = {}

    def _connection(self, rank: int):
        if rank not in self._connections:
            address = self._store.blocking_key_value_get(KEY.format(rank), int(self.timeout * 1000))
            self._connections[rank] = self.server.connect(address)
        return self._connections[rank]

    def offer(self, step: int, arrays: list) -> None:
        """Hold `arrays` for one pull of `step` by another process (dropped after `timeout` if nobody comes)."""
        expires = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout)
        self.server.await_pull(step, arrays, timeout=expires)

    def pull(self, rank: int, step: int, specs: list[jax.ShapeDtypeStruct]) -> list:
        """Start pulling what process `rank` offers for `step`: arrays that become ready when it arrives."""
        return self._connection(rank).pull(step, specs)

    def wait(self, arrays: list, what: str) -> None:
        """Until every one of `arrays` arrived; past the deadline the process ends with one line naming `what`."""
        deadline = time.monotonic() + self.timeout
        delay = 1e-4
        while not all(a.is_ready() for a in arrays):
            if time.monotonic() > deadline:
                die(f"node {self.rank}: {what} did not arrive within {self.timeout:.0f}s (a node died or hangs)")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
        try:
            jax.block_until_ready(arrays)  # ready: raises at once if the transfer failed
        except Exception as e:  # noqa: BLE001 - a failed transfer is a lost node, as a failed collective is
            die(f"node {self.rank}: {what} failed to arrive ({str(e).strip().splitlines()[0][:200]})")
