"""The engine side of KV events: hear the KV manager, flush one `EventBatch` per engine step to a sink.

`KVEventCollector` is the KV manager's listener (engine/kv_cache_manager.py `KVCacheListener`): it turns what it
hears into events and, at `flush()` (the end of each engine step), hands them as one numbered batch to its sink.
A step that changed nothing publishes nothing (and uses no sequence number).

Sinks: `InProcessSink` (readers in the same process: `reader()`; the tests, an embedded router) and
`ZmqEventPublisher`, vLLM's shape: a PUB socket sends `[topic, seq (8 bytes, big-endian), payload]`, and a ROUTER
socket answers a replay request (`seq` to start from, 8 bytes) with every buffered batch from it,
`[seq, payload]` each, then `[-1, b""]`. The buffer keeps the last `buffer_steps` batches; a reader that asks for
older ones gets what is left and must resync (subscriber.py). ZeroMQ sockets belong to one thread: the
publisher's own, fed through a queue, so the engine's step thread never blocks on the network.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from typing import Protocol

from jaxllm.config.kv_events import KVEventsConfig
from jaxllm.engine.block_hash import BlockHash
from jaxllm.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from jaxllm.request import Request

logger = logging.getLogger("jaxllm")

END_OF_REPLAY = -1


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class EventSink(Protocol):
    def publish(self, batch: EventBatch) -> None: ...

    def close(self) -> None: ...


class KVEventCollector:
    """The KV manager's listener: events of the current step, flushed as one batch to `sink`."""

    def __init__(self, sink: EventSink, *, block_size: int, scope: str):
        self.sink = sink
        self.block_size = block_size
        self.scope = scope
        self.pending: list[KVEvent] = []
        self.next_seq = 0
        self.epoch = os.urandom(8).hex()

    def stored(
        self, group: int, hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int], request: Request
    ) -> None:
        lora = request.lora_request.lora_int_id if request.lora_request is not None else None
        event = BlockStored(list(hashes), parent, token_ids, self.block_size, lora, self.scope, group)
        self.pending.append(event)

    def removed(self, group: int, block_hash: BlockHash) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved) and last.group == group:  # one event for a step's evictions
            last.block_hashes.append(block_hash)
        else:
            self.pending.append(BlockRemoved([block_hash], None, self.scope, group))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    def flush(self) -> EventBatch | None:
        """Publish what the step changed as the next batch (nothing: no batch)."""
        if not self.pending:
            return None
        batch = EventBatch(self.next_seq, events=self.pending, epoch=self.epoch)
        self.pending = []
        self.next_seq += 1
        self.sink.publish(batch)
        return batch

    def close(self) -> None:
        self.sink.close()


class InProcessReader:
    """One reader's queue of batches (bounded: a reader that falls behind loses the oldest, and sees the gap)."""

    def __init__(self, maxlen: int):
        self._batches: deque[EventBatch] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def put(self, batch: EventBatch) -> None:
        with self._lock:
            self._batches.append(batch)

    def poll(self) -> list[EventBatch]:
        with self._lock:
            batches = list(self._batches)
            self._batches.clear()
        return batches


class InProcessSink:
    """Batches handed to readers in this process (`publisher: "null"`); also keeps the last `buffer_steps`."""

    def __init__(self, buffer_steps: int = 10_000):
        self.buffer_steps = buffer_steps
        self.readers: list[InProcessReader] = []

    def reader(self) -> InProcessReader:
        reader = InProcessReader(self.buffer_steps)
        self.readers.append(reader)
        return reader

    def publish(self, batch: EventBatch) -> None:
        for reader in self.readers:
            reader.put(batch)

    def close(self) -> None:
        pass


class ZmqEventPublisher:
    """PUB + ROUTER replay sockets on a thread of their own (vLLM's `ZmqEventPublisher`)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, buffer_steps: int, topic: str = ""):
        import zmq

        self.topic = topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # with port 0: the port bound
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        self._queue.put(batch)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                try:
                    batch = self._queue.get(timeout=0.01)
                except queue.Empty:
                    batch = None
                else:
                    if batch is None:
                        return
                    payload = batch.encode()
                    self._buffer.append((batch.seq, payload))
                    self._pub.send_multipart([self.topic, seq_bytes(batch.seq), payload])
                if self._replay is not None and poller.poll(0):
                    self._answer_replay()
        except Exception:  # the engine keeps serving; readers see the silence as a gap when it matters
            logger.exception("the KV events publisher stopped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()
            self._context.term()

    def _answer_replay(self) -> None:
        assert self._replay is not None
        identity, _, start = self._replay.recv_multipart()
        first = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([identity, b"", seq_bytes(seq), payload])
        self._replay.send_multipart([identity, b"", seq_bytes(END_OF_REPLAY), b""])

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)


def make_kv_events(config: KVEventsConfig | None, *, block_size: int, scope: str) -> KVEventCollector | None:
    """The collector for `kv_events_config` (None: KV events off)."""
    if config is None or not config.enable_kv_cache_events:
        return None
    sink: EventSink
    if config.publisher == "zmq":
        sink = ZmqEventPublisher(config.endpoint, config.replay_endpoint, config.buffer_steps, config.topic)
        logger.info("KV events published on %s (replay %s)", sink.endpoint, sink.replay_endpoint)
    else:
        sink = InProcessSink(config.buffer_steps)
    return KVEventCollector(sink, block_size=block_size, scope=scope)
