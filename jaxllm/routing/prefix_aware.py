"""prefix_aware: the instance already holding the longest prefix of the request's blocks, unless load is too
uneven (SGLang's cache-aware policy).

If the load spread (max - min of running + waiting) exceeds `balance_abs_threshold` and the max exceeds
`balance_rel_threshold` x the min, the least loaded instance gets the request: a saturated instance sheds work
even for its own conversations. Otherwise the longest prefix match wins (ties: the least loaded), unless it
covers less than `cache_threshold` of the request's blocks (then the least loaded: a short shared prefix, a system
prompt, is cheap to recompute anywhere). Matching is per (KV scope, adapter, KV group) in the KV-events index.

The index can be behind an instance (a late event, a replay): a request sent to an instance that has since
evicted the prefix is still served correctly there, only computed instead of read from its cache.
"""

from __future__ import annotations

from jaxllm.routing.base import RoutingPolicy
from jaxllm.routing.view import ClusterView, InstanceState, RouteRequest, least_loaded


class PrefixAware(RoutingPolicy):
    name = "prefix_aware"
    needs_block_hashes = True

    def __init__(
        self, balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.0001, cache_threshold: float = 0.5
    ):
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self._turn = 0

    def imbalanced(self, view: ClusterView) -> bool:
        loads = [s.load for s in view.instances]
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def choose(self, request: RouteRequest, view: ClusterView) -> InstanceState:
        self._turn += 1
        if not request.block_hashes or self.imbalanced(view):
            return least_loaded(view.instances, self._turn)
        matched = view.index.match(
            request.block_hashes, scope=request.scope, lora_id=request.lora_id, group=request.group
        )
        best = max((matched.get(s.name, 0) for s in view.instances), default=0)
        if best == 0 or best < self.cache_threshold * len(request.block_hashes):
            return least_loaded(view.instances, self._turn)
        return least_loaded([s for s in view.instances if matched.get(s.name, 0) == best], self._turn)
