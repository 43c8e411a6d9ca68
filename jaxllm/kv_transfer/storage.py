"""SharedStorageConnector: blocks saved as files keyed by their prefix hash, loaded by any engine on the same
storage (`{"shared_storage_path": DIR}`; a restarted server keeps its prefix cache).

A producer saves every full block its requests compute (prompt and output, never unverified drafts) once, in a
background thread; a consumer whose prompt continues on disk past the device cache's hits reads those blocks
(checked against their checksum) and has them scattered in before its first step. Files live under
`DIR/<scope digest>/`, so engines whose KV differs never read each other's (kv_transfer/scope.py); a missing or
corrupt file ends the run of hits there (`recompute`), or fails the request (`fail`).
"""

from __future__ import annotations

import logging
import os
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from jaxllm.engine.block_hash import BlockHash, BlockKey
from jaxllm.kv_cache_groups import SCRATCH_BLOCK
from jaxllm.kv_transfer.base import BlockTables, HostCopyWorker, HostLoad, KVConnectorScheduler

if TYPE_CHECKING:
    from jaxllm.request import Request

logger = logging.getLogger("jaxllm")


class KVLoadError(RuntimeError):
    """External KV could not be read and the failure policy is `fail`: the request ends with this error."""


class BlockFiles:
    """One file per block: K and V `[slots, block_size, kv_heads, head_dim]` and a CRC32 of their bytes."""

    def __init__(self, root: str, scope_key: str, scope_digest: str):
        self.folder = os.path.join(root, scope_digest)
        try:
            os.makedirs(self.folder, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.folder):
                pass
            with open(os.path.join(self.folder, "scope.json"), "w") as f:
                f.write(scope_key)
        except OSError as e:
            raise ValueError(f"kv_transfer_config: shared_storage_path {root!r} is not writable: {e}") from None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-kv-storage")

    def path(self, key: BlockKey) -> str:
        group, block_hash = key
        name = block_hash.hex()
        return os.path.join(self.folder, name[:2], name + (f".g{group}" if group else "") + ".npz")

    def exists(self, key: BlockKey) -> bool:
        return os.path.exists(self.path(key))

    def write(self, keys: list[BlockKey], k: np.ndarray, v: np.ndarray) -> None:
        """Write the blocks in the background (atomically: a reader sees a whole file or none)."""
        self._writer.submit(self._write, keys, k, v)

    def _write(self, keys: list[BlockKey], k: np.ndarray, v: np.ndarray) -> None:
        for i, key in enumerate(keys):
            path = self.path(key)
            if os.path.exists(path):
                continue
            kb, vb = np.ascontiguousarray(k[:, i]), np.ascontiguousarray(v[:, i])
            crc = np.uint32(zlib.crc32(vb.tobytes(), zlib.crc32(kb.tobytes())))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    np.savez(f, k=kb, v=vb, crc=crc)
                os.replace(tmp, path)
            except OSError:
                logger.exception("could not save a KV block to %s", path)
                if os.path.exists(tmp):
                    os.remove(tmp)

    def read(self, key: BlockKey, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, np.ndarray]:
        """A block's K and V; raises ValueError (or OSError) when the file is missing, truncated or corrupt."""
        with np.load(self.path(key)) as f:
            k, v, crc = f["k"], f["v"], f["crc"]
        if k.shape != shape or v.shape != shape or k.dtype != dtype or v.dtype != dtype:
            raise ValueError(f"holds {k.shape} {k.dtype}, expected {shape} {dtype}")
        if np.uint32(zlib.crc32(v.tobytes(), zlib.crc32(k.tobytes()))) != crc:
            raise ValueError("checksum mismatch")
        return k, v

    def flush(self) -> None:
        """Wait for the writes queued so far."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)


class SharedStorageScheduler(KVConnectorScheduler):
    def __init__(self, *args, files: BlockFiles, block_shape: tuple[int, ...], dtype):
        super().__init__(*args)
        self.files, self.block_shape, self.dtype = files, block_shape, np.dtype(dtype)
        self._read: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # request id → needed blocks read, until allocated
        self._saved: dict[str, int] = {}  # request id → leading full blocks saved or found on disk

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Reads the matching blocks now (checked): what is counted is what will load."""
        self._read.pop(request.request_id, None)
        if not self.config.is_consumer:
            return 0, False
        bs = self.block_size
        first, last = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        hashes = self.kv.block_hashes(request, last)
        while (n := self.longest_hit(request, first, last, self.files.exists)) > 0:
            try:  # (a missing or unreadable block ends the hits before it: the rest are computed)
                self._read[request.request_id] = self._read_blocks(request, first, n, hashes)
                return n * bs, False
            except _Unreadable as bad:
                last = bad.block
        return 0, False

    def _read_blocks(self, request: Request, first: int, n: int, hashes: list[BlockHash]):
        """The K and V of the blocks a resume at block `first + n` needs (`needed_blocks`' order), checked."""
        ks, vs = [], []
        for group, i in self.needed_blocks(first, (first + n) * self.block_size):
            key = (group, hashes[i])
            try:
                k, v = self.files.read(key, self.block_shape, self.dtype)
            except Exception as e:  # noqa: BLE001 - a truncated, garbled or foreign file: whatever numpy raises
                self.stats.observe_failure("corrupt")
                message = f"KV block {i} of request {request.request_id} in {self.files.path(key)} is unreadable: {e}"
                if self.config.kv_load_failure_policy == "fail":
                    raise KVLoadError(message) from None
                logger.warning("%s; computing from there", message)
                raise _Unreadable(i) from None
            ks.append(k)
            vs.append(v)
        return np.stack(ks, axis=1), np.stack(vs, axis=1)

    def update_state_after_alloc(self, request: Request, tables: BlockTables, num_external_tokens: int) -> None:
        read = self._read.pop(request.request_id, None)
        if read is None or num_external_tokens == 0:
            return
        first = request.num_computed_tokens // self.block_size
        needed = self.needed_blocks(first, request.num_computed_tokens + num_external_tokens)
        self._loads.append(HostLoad([tables[group][i] for group, i in needed], *read))
        self._saved[request.request_id] = first + num_external_tokens // self.block_size  # on disk already

    def request_computed(self, request: Request, tables: BlockTables, hashes: list[BlockHash]) -> None:
        if not self.config.is_producer:
            return
        done = self._saved.get(request.request_id, 0)
        todo = [
            (table[i], (group, hashes[i]))
            for group, table in enumerate(tables)
            for i in range(done, len(hashes))
            if table[i] != SCRATCH_BLOCK and not self.files.exists((group, hashes[i]))
        ]
        if todo:
            self._saves.append(([block for block, _ in todo], [key for _, key in todo]))
        self._saved[request.request_id] = len(hashes)

    def request_finished(self, request: Request, tables: BlockTables) -> tuple[bool, dict | None]:
        self._saved.pop(request.request_id, None)
        self._read.pop(request.request_id, None)
        return False, None


class SharedStorageWorker(HostCopyWorker):
    """Saves go to the block files (written in the background)."""

    def __init__(self, mover, stats, files: BlockFiles):
        super().__init__(mover, stats, files.write)
        self.files = files

    def flush(self) -> None:
        self.files.flush()

    def close(self) -> None:
        self.files.close()


class _Unreadable(Exception):
    """A stored block could not be read: hits end before `block`."""

    def __init__(self, block: int):
        self.block = block
