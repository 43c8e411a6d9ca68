"""The prefill and decode pools: which instance gets the next request.

The least-loaded instance wins, counting the requests this router has in flight on each (the
router is the only client that matters, and it knows its own counts without asking); ties go
round robin. An instance that just failed is set aside for a few seconds: it is tried after the
others, never dropped, so a pool whose every instance failed still gets tried in full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlsplit

SET_ASIDE_S = 5.0  # how long a failed instance goes to the back of the order


@dataclass(eq=False)
class Instance:
    url: str  # scheme://host:port, no trailing slash
    in_flight: int = 0
    set_aside_until: float = 0.0  # time.monotonic()
    last_error: str | None = None

    def is_set_aside(self) -> bool:
        return time.monotonic() < self.set_aside_until


class InstancePool:
    def __init__(self, role: str, urls: list[str]):
        if not urls:
            raise ValueError(f"at least one {role} instance is needed (--{role} URL)")
        self.role = role
        self.instances = [Instance(normalize_url(url, role)) for url in urls]
        seen: set[str] = set()
        for instance in self.instances:
            if instance.url in seen:
                raise ValueError(f"--{role} names {instance.url} twice")
            seen.add(instance.url)
        self._turn = 0  # where round robin starts among equally loaded instances

    def candidates(self) -> list[Instance]:
        """Every instance, best first: live before set aside, then fewest in flight, ties in turn."""
        n = len(self.instances)
        start, self._turn = self._turn, (self._turn + 1) % n
        ranked = sorted(
            range(n), key=lambda i: (self.instances[i].is_set_aside(), self.instances[i].in_flight, (i - start) % n)
        )
        return [self.instances[i] for i in ranked]

    @staticmethod
    def acquire(instance: Instance) -> None:
        instance.in_flight += 1

    @staticmethod
    def release(instance: Instance) -> None:
        instance.in_flight -= 1

    @staticmethod
    def failed(instance: Instance, error: str) -> None:
        instance.last_error = error
        instance.set_aside_until = time.monotonic() + SET_ASIDE_S

    @staticmethod
    def answered(instance: Instance) -> None:
        instance.last_error = None
        instance.set_aside_until = 0.0


def normalize_url(url: str, role: str) -> str:
    """`http://host:port` (a path prefix is kept); anything else is a start-up error naming the flag."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"--{role} {url!r}: not an http:// or https:// URL of a server (e.g. http://127.0.0.1:8100)")
    try:
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        raise ValueError(f"--{role} {url!r}: the port is not a number in [0, 65535]") from None
    return url.strip().rstrip("/")
