"""TransferConnector: prefill/decode disaggregation, KV pulled from instance to instance with JAX's own transport
(`jax.experimental.transfer`), as tpu-inference does.

Producer (`kv_producer`, `kv_both`): a request sent with `kv_transfer_params: {"do_remote_decode": true}` computes
its prompt; when it finishes, its blocks covering all but the last prompt token are gathered into one array pair
(a compiled gather, sharded as the cache) and offered to the engine's transfer server under a fresh id, with a
lease (`lease_seconds`, default 120): the server drops the offer once pulled or when the lease ends, so a
consumer that never comes costs nothing after it. The device blocks go back to the pool as soon as the gather
is dispatched. The request's output carries the `kv_transfer_params` a consumer needs: the server's address,
the id, the token and block counts, and the producer's KV scope. With the hybrid KV cache manager the offer holds,
group after group, only the blocks each group still holds (a windowed group's last window): `remote_group_starts`
says where each group's begin; a consumer that needs a block the producer no longer had computes the prompt.

Consumer (`kv_consumer`, `kv_both`): a request with `do_remote_prefill` checks the producer's scope (a mismatch
fails the request naming each difference), gets its blocks, and waits in WAITING_FOR_REMOTE_KVS while the pull
runs in the background; each step polls it. Every pull ends in exactly one state within its deadline
(`pull_timeout_seconds`, default 30): received (scattered into the blocks; the request then computes only its
last prompt token), or failed (the producer died, the id was unknown or expired, the deadline passed), and then
`kv_load_failure_policy` decides: `recompute` the prompt here, or `fail` the request. A pull that never
completes is abandoned, never waited on: its arrays are dropped unread, and nothing it might still deliver can
reach the cache.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxllm.kv_cache_groups import SCRATCH_BLOCK
from jaxllm.kv_transfer.base import (
    BlockTables,
    FinishedTransfers,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
)

if TYPE_CHECKING:
    from jaxllm.request import Request

logger = logging.getLogger("jaxllm")

DEFAULT_LEASE_SECONDS = 120.0
DEFAULT_PULL_TIMEOUT_SECONDS = 30.0


@dataclass
class Send:
    request_id: str
    block_ids: list[int]
    transfer_id: int
    lease_seconds: float


@dataclass
class RemoteLoad:
    request_id: str
    block_ids: list[int]  # destination per pulled block (0: the scratch block, dropping it), padded to the bucket
    address: str
    transfer_id: int
    deadline: float  # time.monotonic()


class TransferScheduler(KVConnectorScheduler):
    def __init__(self, *args, address: str, bucket):
        super().__init__(*args)
        self.address = address  # this engine's transfer server (producers)
        self._bucket = bucket  # block count → the padded count a gather of it has (runner/kv_blocks.py)
        self.lease_seconds = float(self.config.extra("lease_seconds", DEFAULT_LEASE_SECONDS))
        self.pull_timeout = float(self.config.extra("pull_timeout_seconds", DEFAULT_PULL_TIMEOUT_SECONDS))
        self._remote: dict[str, dict] = {}  # request id → the producer's params, until its blocks are allocated
        self._consumed: set[str] = set()  # requests whose remote KV was pulled (or tried): never again

    # ---- consumer ----------------------------------------------------------------------------

    def check_request(self, kv_transfer_params: dict) -> None:
        if self.config.is_consumer and kv_transfer_params.get("do_remote_prefill"):
            _check_remote(kv_transfer_params, self.scope)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.sampling_params.kv_transfer_params
        rid = request.request_id
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill") or rid in self._consumed:
            return 0, False
        remote = _check_remote(params, self.scope)
        num_tokens = min(remote["remote_num_tokens"], request.num_prompt_tokens - 1)
        if num_tokens <= num_computed_tokens:
            return 0, False
        starts = _group_starts(remote, len(self.kv.windows))
        if any(i < starts[g] for g, i in self.needed_blocks(num_computed_tokens // self.block_size, num_tokens)):
            return 0, False  # the producer had let a block this resume reads go: compute the prompt here
        self._remote[rid] = remote
        return num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, tables: BlockTables, num_external_tokens: int) -> None:
        remote = self._remote.pop(request.request_id)
        self._consumed.add(request.request_id)
        first = request.num_computed_tokens // self.block_size
        needed = set(self.needed_blocks(first, request.num_computed_tokens + num_external_tokens))
        starts, num_blocks = _group_starts(remote, len(tables)), remote["remote_num_blocks"]
        # the offer's blocks in order, group after group: each to its block here, or dropped into the scratch block
        dest = [
            tables[g][i] if (g, i) in needed else SCRATCH_BLOCK
            for g in range(len(tables))
            for i in range(starts[g], num_blocks)
        ]
        dest += [SCRATCH_BLOCK] * (remote["remote_num_blocks_padded"] - len(dest))
        deadline = time.monotonic() + self.pull_timeout
        self._remote_loads.append(
            RemoteLoad(request.request_id, dest, remote["remote_address"], remote["remote_transfer_id"], deadline)
        )

    # ---- producer ----------------------------------------------------------------------------

    def request_finished(self, request: Request, tables: BlockTables) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._remote.pop(rid, None)
        self._consumed.discard(rid)
        params = request.sampling_params.kv_transfer_params
        if not self.config.is_producer or not params or not params.get("do_remote_decode"):
            return False, None
        if request.status.finish_reason not in ("stop", "length"):  # aborted or failed: nothing to offer
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens - 1)
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks == 0:
            return False, None
        transfer_id = secrets.randbits(62)
        # each group's blocks it still holds (a windowed group let the ones before its window go)
        starts = [next((i for i, b in enumerate(t[:num_blocks]) if b != SCRATCH_BLOCK), num_blocks) for t in tables]
        offered = [b for start, table in zip(starts, tables, strict=True) for b in table[start:num_blocks]]
        self._sends.append(Send(rid, offered, transfer_id, self.lease_seconds))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_address": self.address,
            "remote_transfer_id": transfer_id,
            "remote_num_tokens": num_tokens,
            "remote_num_blocks": num_blocks,
            "remote_group_starts": starts,
            "remote_num_blocks_padded": self._bucket(len(offered)),
            "kv_scope": self.scope.to_dict(),
            "lease_seconds": self.lease_seconds,
        }


def _group_starts(remote: dict, num_groups: int) -> list[int]:
    """Where each group's blocks begin in the producer's table (absent: a producer with one group sends all)."""
    return remote.get("remote_group_starts") or [0] * num_groups


def _check_remote(params: dict, scope) -> dict:
    """The producer's params, checked: its scope must be ours, and every field there."""
    scope.check(params.get("kv_scope"), f"the KV producer at {params.get('remote_address')!r}")
    for name in ("remote_transfer_id", "remote_num_tokens", "remote_num_blocks", "remote_num_blocks_padded"):
        value = params.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"kv_transfer_params: {name} must be a non-negative integer, got {value!r}")
    starts = params.get("remote_group_starts", [0])
    blocks = params["remote_num_blocks"]
    if not isinstance(starts, list) or not all(isinstance(s, int) and 0 <= s <= blocks for s in starts):
        raise ValueError("kv_transfer_params: remote_group_starts must be a list of block indices")
    if not isinstance(params.get("remote_address"), str):
        raise ValueError("kv_transfer_params: remote_address must be a host:port string")
    return params


def _check_reachable(address: str, timeout: float = 2.0) -> None:
    """Raise OSError unless something accepts a TCP connection at host:port (the connection is closed at once):
    JAX's `connect` is lazy, and a pull from nobody never completes."""
    host, _, port = address.rpartition(":")
    socket.create_connection((host, int(port)), timeout=timeout).close()


class TransferWorker(KVConnectorWorker):
    """The engine's transfer server (offers), and the pulls it runs as a consumer (one connection per producer,
    made again after a failure)."""

    def __init__(self, mover, stats, host: str = "127.0.0.1"):
        super().__init__(mover, stats)
        from jaxllm.distributed.stage_link import start_transfer_server

        self.server = start_transfer_server(host)
        self._connections: dict[str, Any] = {}
        self._pending: dict[str, tuple[RemoteLoad, list, float]] = {}  # request id → (load, arrays, started)
        self._finished = FinishedTransfers()

    @property
    def address(self) -> str:
        return self.server.address()

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        self.save_kv(meta)
        for load in meta.remote_loads:
            self._start_pull(load)

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        for send in meta.sends:
            started = time.perf_counter()
            k, v = self.mover.gather_padded(send.block_ids)
            expires = datetime.datetime.now() + datetime.timedelta(seconds=send.lease_seconds)
            self.server.await_pull(send.transfer_id, [k, v], timeout=expires)
            self.stats.observe_transfer("send", self.mover.nbytes(k.shape[1]), time.perf_counter() - started)
            self._finished.sent.append(send.request_id)  # the device blocks may go: the offer holds a copy

    def _start_pull(self, load: RemoteLoad) -> None:
        try:
            connection = self._connections.get(load.address)
            if connection is None:
                _check_reachable(load.address)  # a dead producer's pull would only end at its deadline
                connection = self._connections[load.address] = self.server.connect(load.address)
            spec = self.mover.spec(len(load.block_ids))
            arrays = connection.pull(load.transfer_id, [spec, spec])
        except OSError as e:
            self._fail(load, f"the KV producer at {load.address} is unreachable: {e}", reason="unreachable")
            return
        except Exception as e:  # noqa: BLE001 - any transport error fails this load only
            self._fail(load, f"could not pull KV from {load.address}: {e}")
            return
        self._pending[load.request_id] = (load, arrays, time.perf_counter())

    def get_finished(self) -> FinishedTransfers:
        now = time.monotonic()
        for rid, (load, arrays, started) in list(self._pending.items()):
            try:
                ready = all(a.is_ready() for a in arrays)
                if ready:
                    for a in arrays:
                        a.block_until_ready()  # ready: raises at once if the transfer failed
            except Exception as e:  # noqa: BLE001
                del self._pending[rid]
                self._fail(load, f"the KV transfer from {load.address} failed: {e}")
                continue
            if ready:
                del self._pending[rid]
                self.mover.scatter(load.block_ids, arrays[0], arrays[1])
                nbytes = self.mover.nbytes(len(load.block_ids))
                self.stats.observe_transfer("receive", nbytes, time.perf_counter() - started)
                self._finished.received.append(rid)
            elif now > load.deadline:
                del self._pending[rid]  # abandoned: never read, so never scattered
                self._fail(load, f"timed out waiting for KV from {load.address}", reason="timeout")
        finished, self._finished = self._finished, FinishedTransfers()
        return finished

    def _fail(self, load: RemoteLoad, message: str, reason: str = "transfer") -> None:
        logger.warning("request %s: %s", load.request_id, message)
        self._connections.pop(load.address, None)  # a failed connection does not recover: make a new one
        self.stats.observe_failure(reason)
        self._finished.failed[load.request_id] = message
