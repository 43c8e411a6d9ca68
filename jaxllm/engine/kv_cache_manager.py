"""KV-cache block bookkeeping, pure Python: the block pool, block tables and the prefix cache.

Block 0 is a scratch block that padding tokens write into; blocks 1..N-1 are handed out.
Free blocks wait in an LRU queue (an OrderedDict: O(1) pop from the front, O(1) removal
of a block that a cache hit revives). With prefix caching, every full block is named by a
chained content hash (engine/block_hash.py: sha256 over the parent block's hash and its token ids, the
same in every process); a freed block keeps its hash and can be hit again until it is evicted, least
recently freed first. Evictions are recorded (`take_evicted`) for a KV connector that offloads them.
An optional `listener` hears each block the prefix cache gains or drops and a reset (KV events: kv_events/); the
manager knows nothing of how they travel.

A request has one block table per KV cache group (kv_cache_groups.py), all drawn from the one pool. A sliding-window
group's blocks that leave the window go back to the pool as the request advances (during decode and long chunked
prefills); their entries become the scratch block, so the table still maps position // block_size to a block, and
attention never reads them (it skips keys outside the window). A block is cached per group: a prefix hit needs every
block of a full-attention group, and only the blocks inside the window before the hit point of a windowed one
(vLLM's rule).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from jaxllm.engine.block_hash import NO_SCOPE, BlockHash, BlockKey, hash_block, scoped_root
from jaxllm.kv_cache_groups import SCRATCH_BLOCK
from jaxllm.request import Request


class PrefixHit(NamedTuple):
    """Leading blocks of a request the prefix cache holds: per group, a block id per block (the scratch block where a
    windowed group needs none)."""

    num_blocks: int
    block_ids: list[list[int]]


NO_HIT = PrefixHit(0, [])


class KVCacheListener(Protocol):
    """Hears the prefix cache change (kv_events/publisher.py publishes what it hears)."""

    def stored(
        self, group: int, hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int], request: Request
    ) -> None:
        """`hashes`: consecutive blocks of `group` just cached; `parent` the hash before the first (None: the root)."""

    def removed(self, group: int, block_hash: BlockHash) -> None:
        """A cached block's hash was dropped (evicted for reuse, or its K/V declared invalid)."""

    def cleared(self) -> None:
        """Every cached hash was dropped (`reset_prefix_cache`)."""


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group = 0  # the KV cache group whose K/V its hash names


class KVCacheManager:
    """`windows`: one per KV cache group, its layers' sliding window (None: full attention); one group by default."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        root: BlockHash = NO_SCOPE,
        record_evictions: bool = False,
        windows: Sequence[int | None] = (None,),
    ):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.root = root  # the first block's parent: scopes every hash to compatible KV
        self._cached: dict[tuple[int, BlockHash], int] = {}  # (group, block hash) → block id
        self._req_blocks: dict[str, list[list[int]]] = {}  # a block table per group
        self._req_hashes: dict[str, list[BlockHash]] = {}  # chained hashes of a request's full blocks
        self._req_num_registered: dict[str, int] = {}  # leading blocks already offered to the cache
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self._evicted: list[tuple[int, BlockKey]] | None = [] if record_evictions else None
        self.listener: KVCacheListener | None = None  # KV events (kv_events/publisher.py)

    # ---- pool state --------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table of each group (the manager's own lists)."""
        return self._req_blocks.get(request_id) or [[] for _ in self.windows]

    def block_ids(self, request_id: str) -> list[int]:
        """The first group's block table (a model with one group: its only one)."""
        return self.block_tables(request_id)[0]

    def first_needed(self, group: int, position: int) -> int:
        """The first block of `group` a token at `position` (or after it) attends to."""
        window = self.windows[group]
        return 0 if window is None else max(position - window + 1, 0) // self.block_size

    # ---- prefix cache ------------------------------------------------------------------

    def root_of(self, request: Request) -> BlockHash:
        """The first block's parent: the KV's scope, and a LoRA adapter's (its blocks never serve another)."""
        return scoped_root(self.root, request.lora_scope) if request.lora_scope else self.root

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first `num_blocks` full blocks (computed once, kept)."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        prompt, output = request.prompt_token_ids, request.output_token_ids
        n = len(prompt)
        while len(hashes) < num_blocks:
            start, end = len(hashes) * bs, (len(hashes) + 1) * bs
            tokens = tuple(prompt[start:end] + output[max(start - n, 0) : max(end - n, 0)])
            hashes.append(hash_block(hashes[-1] if hashes else self.root_of(request), tokens))
        return hashes[:num_blocks]

    def _lookup(self, request: Request) -> PrefixHit:
        """The longest prefix every group can resume from: whole for full attention, the window before it for a
        windowed group (a shorter hit can need blocks a longer one did not, so the groups settle on one length)."""
        if not self.enable_prefix_caching:
            return NO_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request, max_blocks)[:max_blocks]
        found = [self._cached_ids(group, hashes) for group in range(len(self.windows))]
        hit, settled = max_blocks, -1
        while hit != settled:
            settled = hit
            for group, ids in enumerate(found):
                hit = min(hit, self._longest_hit(group, ids, hit))
        tables = []
        for group, ids in enumerate(found):
            first = self.first_needed(group, hit * self.block_size)
            tables.append([SCRATCH_BLOCK] * first + [i for i in ids[first:hit] if i is not None])
        return PrefixHit(hit, tables)

    def _cached_ids(self, group: int, hashes: list[BlockHash]) -> list[int | None]:
        """The group's cached block of each hash (None: not cached); a full-attention group's only up to its first
        miss, since no hit reaches past it."""
        if self.windows[group] is not None:
            return [self._cached.get((group, h)) for h in hashes]
        ids: list[int | None] = []
        for h in hashes:
            block_id = self._cached.get((group, h))
            if block_id is None:
                break
            ids.append(block_id)
        return ids

    def _longest_hit(self, group: int, ids: list[int | None], limit: int) -> int:
        """The most leading blocks, at most `limit`, after which `group` has every block it still reads cached."""
        if self.windows[group] is None:
            return min(len(ids), limit)  # (`_cached_ids`: its leading cached blocks)
        top = limit  # the end of the run of cached blocks below it
        for i in range(limit - 1, -1, -1):
            if ids[i] is None:
                top = i
            elif i <= self.first_needed(group, top * self.block_size):
                return top
        return top

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens the prefix cache would supply now; no side effects (for policies such as `lpm`)."""
        return self._lookup(request).num_blocks * self.block_size

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """Leading cached blocks of a new request's tokens; at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return NO_HIT
        hit = self._lookup(request)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += hit.num_blocks * self.block_size
        return hit

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's blocks that `num_tokens` known tokens fill to the prefix cache."""
        rid = request.request_id
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._req_num_registered.get(rid, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        for group, table in enumerate(self._req_blocks[rid]):
            stored: list[int] = []  # block indices this call caches, for the listener
            for i in range(start, num_full):
                block, key = self.blocks[table[i]], (group, hashes[i])
                if block.block_id != SCRATCH_BLOCK and block.block_hash is None and key not in self._cached:
                    block.block_hash, block.group = hashes[i], group
                    self._cached[key] = block.block_id
                    stored.append(i)
            if self.listener is not None and stored:
                self._tell_stored(request, group, hashes, stored)
        self._req_num_registered[rid] = num_full

    def _tell_stored(self, request: Request, group: int, hashes: list[BlockHash], stored: list[int]) -> None:
        """One `stored` call per run of consecutive block indices (each run's parent is the block before it)."""
        assert self.listener is not None
        bs, tokens = self.block_size, request.prompt_token_ids + request.output_token_ids
        run_start = 0
        for j in range(1, len(stored) + 1):
            if j == len(stored) or stored[j] != stored[j - 1] + 1:
                first, last = stored[run_start], stored[j - 1]
                parent = hashes[first - 1] if first > 0 else None
                self.listener.stored(
                    group, hashes[first : last + 1], parent, list(tokens[first * bs : (last + 1) * bs]), request
                )
                run_start = j

    def _uncache(self, block: KVBlock, evicting: bool = False) -> None:
        if block.block_hash is not None:
            if evicting and self._evicted is not None:
                self._evicted.append((block.block_id, (block.group, block.block_hash)))
            if self._cached.get((block.group, block.block_hash)) == block.block_id:
                del self._cached[block.group, block.block_hash]
                if self.listener is not None:
                    self.listener.removed(block.group, block.block_hash)
            block.block_hash = None

    # ---- allocation --------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: PrefixHit = NO_HIT, num_external: int = 0
    ) -> bool:
        """Make the request's tables cover its computed tokens, the `computed` hit and `num_new_tokens` more, of
        which the first `num_external` a KV connector loads: a windowed group then gets blocks only from the window
        of the first token computed after them. A windowed group first returns the blocks its window has left.
        Returns False, changing nothing else, when the pool is too small."""
        rid = request.request_id
        tables = self._req_blocks.get(rid) or [[] for _ in self.windows]
        start = request.num_computed_tokens + computed.num_blocks * self.block_size  # this step's first position
        computes_from = start + num_external
        num_entries = -(-(start + num_new_tokens) // self.block_size)
        self._release_out_of_window(tables, start)
        num_needed = revived = 0
        for group, table in enumerate(tables):
            have = len(table) + computed.num_blocks
            num_needed += max(num_entries - max(have, self.first_needed(group, computes_from)), 0)
        for ids in computed.block_ids:
            revived += sum(1 for b in ids if b != SCRATCH_BLOCK and self.blocks[b].ref_cnt == 0)
        if num_needed + revived > len(self._free):
            return False
        self._req_blocks[rid] = tables
        for table, ids in zip(tables, computed.block_ids, strict=False):
            for block_id in ids:
                self._take(block_id)
                table.append(block_id)
        if computed.num_blocks:
            self._req_num_registered[rid] = computed.num_blocks
        for group, table in enumerate(tables):
            table.extend([SCRATCH_BLOCK] * (self.first_needed(group, computes_from) - len(table)))
            for _ in range(num_entries - len(table)):
                block_id, _ = self._free.popitem(last=False)
                self._uncache(self.blocks[block_id], evicting=True)  # evict whatever it held
                self._take(block_id)
                table.append(block_id)
        total = start + num_new_tokens
        if self.enable_prefix_caching and total // self.block_size > self._req_num_registered.get(rid, 0):
            self._register_full_blocks(request, total)
        return True

    def _release_out_of_window(self, tables: list[list[int]], position: int) -> None:
        """Windowed groups: blocks before the window of the token at `position` go back to the pool (their
        entries become the scratch block; what was freed before is already so)."""
        for group, table in enumerate(tables):
            i = min(self.first_needed(group, position), len(table)) - 1
            while i >= 0 and table[i] != SCRATCH_BLOCK:
                self._release(table[i])
                table[i] = SCRATCH_BLOCK
                i -= 1

    def _take(self, block_id: int) -> None:
        if block_id == SCRATCH_BLOCK:
            return
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            self._free.pop(block_id, None)
        block.ref_cnt += 1

    def _release(self, block_id: int, uncache: bool = False) -> None:
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        if uncache:
            self._uncache(block)
        if block.ref_cnt == 0:
            self._free[block_id] = None
            if block.block_hash is None:  # holds nothing reusable: hand it out first
                self._free.move_to_end(block_id, last=False)

    def fork(self, parent: Request, child: Request, num_blocks: int) -> None:
        """Share the parent's first `num_blocks` (full, immutable) blocks of each group with a child sample."""
        tables = [list(table[:num_blocks]) for table in self._req_blocks[parent.request_id]]
        for table in tables:
            for block_id in table:
                self._take(block_id)
        self._req_blocks[child.request_id] = tables
        self._req_num_registered[child.request_id] = num_blocks

    def free(self, request: Request, *, uncache: bool = False) -> None:
        """Return the request's blocks; `uncache` also forgets the hashes of blocks whose K/V may be invalid."""
        rid = request.request_id
        for table in self._req_blocks.pop(rid, []):
            for block_id in reversed(table):
                if block_id != SCRATCH_BLOCK:
                    self._release(block_id, uncache)
        self._req_hashes.pop(rid, None)
        self._req_num_registered.pop(rid, None)

    def take_evicted(self) -> list[tuple[int, BlockKey]]:
        """(block id, (group, hash)) of the cached blocks evicted since the last call; their K/V is intact until the
        next step runs (with `record_evictions`; else always empty)."""
        evicted, self._evicted = self._evicted or [], [] if self._evicted is not None else None
        return evicted

    def uncache_from(self, request: Request, first_block: int) -> None:
        """Forget the hashes of the request's blocks from `first_block` on (their K/V is not what they claim)."""
        for table in self._req_blocks.get(request.request_id, []):
            for block_id in table[first_block:]:
                if block_id != SCRATCH_BLOCK:
                    self._uncache(self.blocks[block_id])
        rid = request.request_id
        self._req_num_registered[rid] = min(self._req_num_registered.get(rid, 0), first_block)

    def reset_prefix_cache(self) -> None:
        listener, self.listener = self.listener, None  # one AllBlocksCleared, not a BlockRemoved per block
        try:
            for block in self.blocks:
                self._uncache(block)
        finally:
            self.listener = listener
        if listener is not None:
            listener.cleared()
