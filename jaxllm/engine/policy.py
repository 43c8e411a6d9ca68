"""Waiting-queue policies: the scheduling research plug-in point.

A policy orders the waiting queue and picks the preemption victim among running
requests. Add one by subclassing `WaitingQueue` and registering it in `POLICIES`; the
scheduler, simulator and benchmarks take it by name (`SchedulerConfig.policy`).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from jaxllm.engine.request import Request


class WaitingQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Return a preempted request to the queue, ahead of requests of the same standing."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    @staticmethod
    @abstractmethod
    def select_victim(candidates: list[Request]) -> Request:
        """The running request to preempt when KV blocks run out."""


class FCFSQueue(WaitingQueue):
    """First come, first served; the latest admitted running request is preempted first."""

    def __init__(self):
        self._queue: deque[Request] = deque()

    def add(self, request):
        self._queue.append(request)

    def prepend(self, request):
        self._queue.appendleft(request)

    def peek(self):
        return self._queue[0]

    def pop(self):
        return self._queue.popleft()

    def remove(self, request):
        self._queue.remove(request)

    def __len__(self):
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue)

    @staticmethod
    def select_victim(candidates):
        return candidates[-1]


class PriorityQueue(WaitingQueue):
    """Lowest `priority` value first, then earliest arrival; the worst running request is preempted."""

    def __init__(self):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    @staticmethod
    def _key(request):
        return request.priority, request.arrival_time

    def add(self, request):
        heapq.heappush(self._heap, (*self._key(request), next(self._order), request))

    prepend = add  # its arrival time already places it ahead of later requests of its priority

    def peek(self):
        return self._heap[0][-1]

    def pop(self):
        return heapq.heappop(self._heap)[-1]

    def remove(self, request):
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self):
        return len(self._heap)

    def __iter__(self):
        return (entry[-1] for entry in sorted(self._heap))

    @staticmethod
    def select_victim(candidates):
        return max(candidates, key=PriorityQueue._key)


POLICIES: dict[str, type[WaitingQueue]] = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy not in POLICIES:
        raise ValueError(f"scheduling policy {policy!r} is not one of {', '.join(POLICIES)}")
    return POLICIES[policy]()
