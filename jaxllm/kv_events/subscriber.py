"""The reading side of KV events: batches applied in sequence, a gap replayed or the view resynced.

`EventSequencer` holds the rule every reader keeps. Batches are numbered 0, 1, 2, ...; a batch that follows the
last one applied is applied; a repeat is dropped; after a jump the missing batches are asked for (`replay`, the
publisher's ROUTER socket) and, if the replay covers the whole gap, applied first. If it cannot (the publisher's
buffer has moved on, or no replay socket answers), the handler is told to `resync`: it forgets everything it knew
about that instance (its blocks count as not held until stored again), then the new batch is applied. A reader
never keeps acting on a view it knows has holes. A reader that joins late asks for the replay from 0 the same way
(`catch_up`: a `SubscriberThread` does it for each subscriber as it starts); a batch of another epoch (each publisher
start draws one) means the engine restarted (an empty cache): resync, and start over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from jaxllm.kv_events.events import EventBatch
from jaxllm.kv_events.publisher import END_OF_REPLAY, InProcessReader, seq_bytes

logger = logging.getLogger("jaxllm")

REPLAY_TIMEOUT_MS = 1000  # a replay socket that says nothing for this long: the gap cannot be filled


class EventHandler(Protocol):
    def apply(self, batch: EventBatch) -> None: ...

    def resync(self) -> None: ...


class EventSequencer:
    def __init__(self, handler: EventHandler, replay: Callable[[int], list[EventBatch]] | None = None, name: str = ""):
        self.handler = handler
        self.replay = replay
        self.name = name
        self.last_seq: int | None = None
        self.gaps = 0  # jumps seen
        self.resyncs = 0  # jumps a replay could not fill
        self.restarts = 0  # epochs that changed (a restarted publisher)
        self.epoch: str | None = None

    def catch_up(self) -> None:
        """Apply what the replay holds from the next batch on (a reader joining late need not wait for a live one)."""
        if self.replay is None:
            return
        try:
            batches = sorted(self.replay(0 if self.last_seq is None else self.last_seq + 1), key=lambda b: b.seq)
        except Exception as e:
            logger.warning("KV events catch-up from %s failed: %s", self.name or "the publisher", e)
            return
        for batch in batches:
            self.receive(batch)

    def receive(self, batch: EventBatch) -> None:
        """A batch from the live stream (replayed ones come through `replay`)."""
        if self.epoch is not None and batch.epoch != self.epoch:
            # another epoch: the publisher restarted (its engine's cache is new), so nothing known holds
            self.restarts += 1
            logger.warning(
                "KV events%s: the publisher restarted; starting over", f" from {self.name}" if self.name else ""
            )
            self.handler.resync()
            self.last_seq = None
        self.epoch = batch.epoch
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if batch.seq < expected:
            return  # a repeat (a catch-up replay overlapping the live stream)
        if batch.seq > expected:
            self.gaps += 1
            missing = self._replayed(expected, batch.seq)
            if missing is None:
                self.resyncs += 1
                logger.warning(
                    "KV events%s: batches %d..%d missed and not replayable: the instance's blocks count as unknown",
                    f" from {self.name}" if self.name else "",
                    expected,
                    batch.seq - 1,
                )
                self.handler.resync()
            else:
                for old in missing:
                    self.handler.apply(old)
        self.handler.apply(batch)
        self.last_seq = batch.seq

    def _replayed(self, first: int, end: int) -> list[EventBatch] | None:
        """Batches first..end-1 from the replay, or None when it cannot give every one of them."""
        if self.replay is None:
            return None
        try:
            batches = {b.seq: b for b in self.replay(first) if first <= b.seq < end}
        except Exception as e:  # a replay that fails is a replay that cannot cover the gap
            logger.warning("KV events replay from %s failed: %s", self.name or "the publisher", e)
            return None
        if len(batches) != end - first:
            return None
        return [batches[s] for s in range(first, end)]


class InProcessSubscriber:
    """An in-process reader (publisher `null`) with the same gap rule (no replay: a gap resyncs)."""

    def __init__(self, reader: InProcessReader, handler: EventHandler):
        self.reader = reader
        self.sequencer = EventSequencer(handler)

    def poll(self) -> int:
        batches = self.reader.poll()
        for batch in batches:
            self.sequencer.receive(batch)
        return len(batches)


class ZmqEventSubscriber:
    """A publisher's PUB socket (and its replay socket), read into `handler`."""

    def __init__(self, endpoint: str, handler: EventHandler, *, replay_endpoint: str | None = None, topic: str = ""):
        import zmq

        self._zmq = zmq
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.context: zmq.Context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.connect(endpoint)
        self.sequencer = EventSequencer(handler, self._replay if replay_endpoint else None, endpoint)

    def receive_ready(self) -> int:
        """Apply every message waiting on the socket (never blocks); returns how many."""
        count = 0
        while True:
            try:
                _topic, seq, payload = self.socket.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return count
            self.sequencer.receive(EventBatch.decode(int.from_bytes(seq, "big", signed=True), payload))
            count += 1

    def _replay(self, first: int) -> list[EventBatch]:
        zmq = self._zmq
        dealer = self.context.socket(zmq.DEALER)  # a fresh socket: a late answer to an earlier ask never mixes in
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", seq_bytes(first)])
            batches: list[EventBatch] = []
            while dealer.poll(REPLAY_TIMEOUT_MS):
                _, seq_raw, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_raw, "big", signed=True)
                if seq == END_OF_REPLAY:
                    return batches
                batches.append(EventBatch.decode(seq, payload))
            raise TimeoutError(f"no end of replay from {self.replay_endpoint} in {REPLAY_TIMEOUT_MS} ms")
        finally:
            dealer.close()

    def close(self) -> None:
        self.socket.close()


class SubscriberThread:
    """Polls many subscribers' sockets on one daemon thread until `stop()`: a router with a thousand instances
    runs one thread, not a thousand. Subscribers join as their instances are found (`add`, from any thread); the
    thread registers each and catches it up (blocking the others' events up to the replay timeout) before polling
    it. They leave as their instances die (`remove`): the thread closes the socket, which only it may touch."""

    def __init__(self, subscribers: list[ZmqEventSubscriber] | None = None, poll_ms: int = 100):
        import zmq

        self.subscribers: list[ZmqEventSubscriber] = []
        self.poller = zmq.Poller()
        self._by_socket: dict = {}
        self._joining: list[ZmqEventSubscriber] = list(subscribers or [])
        self._leaving: list[tuple[ZmqEventSubscriber, Callable[[], None] | None]] = []
        self._lock = threading.Lock()  # guards _joining and _leaving
        self._stop = threading.Event()
        self._poll_ms = poll_ms
        self.thread = threading.Thread(target=self._run, name="kv-events-subscriber", daemon=True)

    def start(self) -> SubscriberThread:
        self.thread.start()
        return self

    def add(self, sub: ZmqEventSubscriber) -> None:
        """Read `sub` too, from the thread's next poll on (within `poll_ms`); the first starts the thread."""
        with self._lock:
            self._joining.append(sub)
            if not self.thread.is_alive() and not self._stop.is_set():
                self.thread.start()

    def remove(self, sub: ZmqEventSubscriber, then: Callable[[], None] | None = None) -> None:
        """Stop reading `sub` and close it on the thread's next poll, then call `then` there (e.g. forget the
        instance's blocks: after the last of its events, so none lands after it)."""
        with self._lock:
            self._leaving.append((sub, then))

    def _update(self) -> None:
        import zmq

        with self._lock:
            joining, self._joining = self._joining, []
            leaving, self._leaving = self._leaving, []
        for sub, then in leaving:
            if sub in joining:
                joining.remove(sub)
            elif sub in self.subscribers:
                self.subscribers.remove(sub)
                del self._by_socket[sub.socket]
                self.poller.unregister(sub.socket)
            sub.close()
            if then is not None:
                then()
        for sub in joining:
            self.subscribers.append(sub)
            self._by_socket[sub.socket] = sub
            self.poller.register(sub.socket, zmq.POLLIN)
            sub.sequencer.catch_up()  # what was published before we connected

    def _run(self) -> None:
        while not self._stop.is_set():
            self._update()
            for socket, _ in self.poller.poll(self._poll_ms):
                try:
                    self._by_socket[socket].receive_ready()
                except Exception:  # one instance's bad message never stops the others' events
                    logger.exception("KV events from %s", self._by_socket[socket].endpoint)

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(5)
        with self._lock:
            joining, self._joining = self._joining, []
        for sub in self.subscribers + joining:
            sub.close()
