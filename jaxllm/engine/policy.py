"""Scheduling policies: the plug-in point for scheduling research.

A policy is a waiting queue with three decisions:

- **order**: which waiting request is admitted next (`peek`/`pop`; `begin_step` may reorder
  once per step with a look at the KV cache, as `lpm` does);
- **victim**: which running request to preempt when KV blocks run out (`select_victim`);
- **admission** (optional): whether the head of the queue may start now (`can_admit`), for
  rules such as keeping headroom in the KV pool.

The engine, the simulator and the benchmarks take a policy by name (`scheduling_policy=`,
`--scheduling-policy`): a name in `POLICIES`, or a dotted path to a user's class,
`pkg.module:Class` or `pkg.module.Class`. Register a class of your own under a short name with
`@register_policy("name")`. The scheduler never looks inside the queue, so any order works.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from jaxllm.plugins import load_class
from jaxllm.request import Request

if TYPE_CHECKING:
    from jaxllm.engine.kv_cache_manager import KVCacheManager


class WaitingQueue(ABC):
    """The interface. Subclass `FCFSQueue` or `KeyedQueue` to change one decision only."""

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
    def __iter__(self) -> Iterator[Request]:
        """The requests in the order they would be admitted."""

    def select_victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt when KV blocks run out; `candidates` are in admission order.

        Default: the latest admitted (it has the least work to lose).
        """
        return candidates[-1]

    def begin_step(self, kv: KVCacheManager) -> None:  # noqa: B027 (an optional hook: by default nothing to do)
        """Called before admissions in each step with room for one: reorder here if the order depends on state."""

    def can_admit(self, request: Request, running: list[Request], kv: KVCacheManager) -> bool:
        """Whether the head of the queue may start this step (admission stops at the first refusal)."""
        return True


POLICIES: dict[str, type[WaitingQueue]] = {}


def register_policy(name: str):
    """Class decorator: make a policy selectable by `name`."""

    def register(cls: type[WaitingQueue]) -> type[WaitingQueue]:
        POLICIES[name] = cls
        return cls

    return register


@register_policy("fcfs")
class FCFSQueue(WaitingQueue):
    """First come, first served (vLLM's default); the latest admitted running request is preempted first."""

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


class KeyedQueue(WaitingQueue):
    """Admits the request with the smallest `key`, arrival order breaking ties; preempts the largest key."""

    def __init__(self):
        self._heap: list[tuple] = []
        self._order = itertools.count()

    @staticmethod
    @abstractmethod
    def key(request: Request) -> tuple: ...

    def add(self, request):
        heapq.heappush(self._heap, (self.key(request), request.arrival_time, next(self._order), request))

    prepend = add  # its arrival time already places it ahead of later requests of the same key

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
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def select_victim(self, candidates):
        # the largest key; among equals the latest arrival, then the latest admitted
        return max(reversed(candidates), key=lambda r: (self.key(r), r.arrival_time))


@register_policy("priority")
class PriorityQueue(KeyedQueue):
    """Lowest `priority` value first, then earliest arrival (vLLM's `priority`); the worst running one is preempted."""

    @staticmethod
    def key(request):
        return (request.priority,)


@register_policy("sjf")
class ShortestJobFirstQueue(KeyedQueue):
    """Shortest job first: the shortest expected output when the request carries one, else the shortest prompt.

    The classic mean-latency-optimal order (SRPT's non-preemptive cousin); with predicted output
    lengths it is the "learning to rank" / S3 line of LLM schedulers. It can starve long requests.
    """

    @staticmethod
    def key(request):
        expected = request.expected_output_len
        return (expected if expected is not None else request.num_prompt_tokens,)


@register_policy("lpm")
class LongestPrefixMatchQueue(FCFSQueue):
    """Longest prefix match first (SGLang's `lpm`): requests whose prompt the prefix cache holds most of go first.

    Serving them while their prefix is still cached raises the hit rate and saves prefill. As in
    SGLang, only the oldest `window` waiting requests are ranked (beyond it the queue is FCFS), which
    bounds the per-step cost and the starvation of requests that share nothing.
    """

    window = 128

    def begin_step(self, kv):
        if len(self._queue) < 2 or not kv.enable_prefix_caching:
            return
        head = [self._queue.popleft() for _ in range(min(self.window, len(self._queue)))]
        head.sort(key=kv.num_cached_prefix_tokens, reverse=True)  # stable: FCFS among equal matches
        self._queue.extendleft(reversed(head))


@register_policy("fair")
class FairQueue(WaitingQueue):
    """Round-robin admission across `user`s, so one tenant's burst cannot starve the others.

    Each user has a FCFS queue; admissions take turns between users with waiting requests. The
    victim is the latest admitted request of the user holding the most running requests. A
    request-count cousin of the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
    Language Models", OSDI 2024), which counts tokens instead.
    """

    def __init__(self):
        self._queues: dict[str | None, deque[Request]] = {}
        self._turns: deque[str | None] = deque()  # users with waiting requests, next to serve first
        self._size = 0

    def _user_queue(self, request: Request) -> deque[Request]:
        if request.user not in self._queues:
            self._queues[request.user] = deque()
            self._turns.append(request.user)
        return self._queues[request.user]

    def add(self, request):
        self._user_queue(request).append(request)
        self._size += 1

    def prepend(self, request):
        self._user_queue(request).appendleft(request)
        self._size += 1

    def peek(self):
        return self._queues[self._turns[0]][0]

    def pop(self):
        user = self._turns.popleft()
        queue = self._queues[user]
        request = queue.popleft()
        self._size -= 1
        if queue:
            self._turns.append(user)
        else:
            del self._queues[user]
        return request

    def remove(self, request):
        queue = self._queues[request.user]
        queue.remove(request)
        self._size -= 1
        if not queue:
            del self._queues[request.user]
            self._turns.remove(request.user)

    def __len__(self):
        return self._size

    def __iter__(self):
        queues = [list(self._queues[user]) for user in self._turns]
        for row in itertools.zip_longest(*queues):
            yield from (r for r in row if r is not None)

    def select_victim(self, candidates):
        counts: dict[str | None, int] = {}
        for r in candidates:
            counts[r.user] = counts.get(r.user, 0) + 1
        heaviest = max(counts.values())
        return next(r for r in reversed(candidates) if counts[r.user] == heaviest)


def resolve_policy(policy: str) -> type[WaitingQueue]:
    """A policy class from a registered name or a dotted path (`pkg.module:Class` or `pkg.module.Class`)."""
    return load_class(policy, POLICIES, WaitingQueue, "scheduling policy")


def make_waiting_queue(policy: str) -> WaitingQueue:
    return resolve_policy(policy)()
