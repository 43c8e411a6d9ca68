"""KV-cache block bookkeeping, pure Python: the block pool, block tables and the prefix cache.

Block 0 is a scratch block that padding tokens write into; blocks 1..N-1 are handed out.
Free blocks wait in an LRU queue (an OrderedDict: O(1) pop from the front, O(1) removal
of a block that a cache hit revives). With prefix caching, every full block is named by a
chained content hash (engine/block_hash.py: sha256 over the parent block's hash and its token ids, the
same in every process); a freed block keeps its hash and can be hit again until it is evicted, least
recently freed first. Evictions are recorded (`take_evicted`) for a KV connector that offloads them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from jaxllm.engine.block_hash import NO_SCOPE, BlockHash, hash_block
from jaxllm.request import Request


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        root: BlockHash = NO_SCOPE,
        record_evictions: bool = False,
    ):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.root = root  # the first block's parent: scopes every hash to compatible KV
        self._cached: dict[BlockHash, int] = {}  # block hash → block id
        self._req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}  # chained hashes of a request's full blocks
        self._req_num_registered: dict[str, int] = {}  # leading blocks already offered to the cache
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self._evicted: list[tuple[int, BlockHash]] | None = [] if record_evictions else None

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

    def block_ids(self, request_id: str) -> list[int]:
        return self._req_blocks.get(request_id, [])

    # ---- prefix cache ------------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first `num_blocks` full blocks (computed once, kept)."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        prompt, output = request.prompt_token_ids, request.output_token_ids
        n = len(prompt)
        while len(hashes) < num_blocks:
            start, end = len(hashes) * bs, (len(hashes) + 1) * bs
            tokens = tuple(prompt[start:end] + output[max(start - n, 0) : max(end - n, 0)])
            hashes.append(hash_block(hashes[-1] if hashes else self.root, tokens))
        return hashes[:num_blocks]

    def _lookup(self, request: Request) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self.block_hashes(request, max_blocks)[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens the prefix cache would supply now; no side effects (for policies such as `lpm`)."""
        return len(self._lookup(request)) * self.block_size

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Leading cached blocks of a new request's tokens; at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        hits = self._lookup(request)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's blocks that `num_tokens` known tokens fill to the prefix cache."""
        rid = request.request_id
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._req_num_registered.get(rid, 0)
        if num_full <= start:
            return
        blocks = self._req_blocks[rid]
        for i, block_hash in enumerate(self.block_hashes(request, num_full)[start:num_full], start):
            block = self.blocks[blocks[i]]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
        self._req_num_registered[rid] = num_full

    def _uncache(self, block: KVBlock, evicting: bool = False) -> None:
        if block.block_hash is not None:
            if evicting and self._evicted is not None:
                self._evicted.append((block.block_id, block.block_hash))
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
            block.block_hash = None

    # ---- allocation --------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make the request's table cover its computed tokens, `computed_blocks` and `num_new_tokens` more.

        Returns False, changing nothing, when the pool is too small.
        """
        rid = request.request_id
        blocks = self._req_blocks.setdefault(rid, [])
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0) if computed_blocks else 0
        if num_needed + revived > len(self._free):
            if not blocks:
                del self._req_blocks[rid]
            return False
        for block_id in computed_blocks:
            self._take(block_id)
            blocks.append(block_id)
        if computed_blocks:
            self._req_num_registered[rid] = len(blocks)
        for _ in range(max(num_needed, 0)):
            block_id, _ = self._free.popitem(last=False)
            self._uncache(self.blocks[block_id], evicting=True)  # evict whatever it held
            self._take(block_id)
            blocks.append(block_id)
        if self.enable_prefix_caching and total // self.block_size > self._req_num_registered.get(rid, 0):
            self._register_full_blocks(request, total)
        return True

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            self._free.pop(block_id, None)
        block.ref_cnt += 1

    def fork(self, parent: Request, child: Request, num_blocks: int) -> None:
        """Share the parent's first `num_blocks` (full, immutable) blocks with a child sample."""
        shared = self._req_blocks[parent.request_id][:num_blocks]
        for block_id in shared:
            self._take(block_id)
        self._req_blocks[child.request_id] = list(shared)
        self._req_num_registered[child.request_id] = len(shared)

    def free(self, request: Request, *, uncache: bool = False) -> None:
        """Return the request's blocks; `uncache` also forgets the hashes of blocks whose K/V may be invalid."""
        rid = request.request_id
        for block_id in reversed(self._req_blocks.pop(rid, [])):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if uncache:
                self._uncache(block)
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:  # holds nothing reusable: hand it out first
                    self._free.move_to_end(block_id, last=False)
        self._req_hashes.pop(rid, None)
        self._req_num_registered.pop(rid, None)

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the cached blocks evicted since the last call; their K/V is intact until the next
        step runs (with `record_evictions`; else always empty)."""
        evicted, self._evicted = self._evicted or [], [] if self._evicted is not None else None
        return evicted

    def uncache_from(self, request: Request, first_block: int) -> None:
        """Forget the hashes of the request's blocks from `first_block` on (their K/V is not what they claim)."""
        for block_id in self._req_blocks.get(request.request_id, [])[first_block:]:
            self._uncache(self.blocks[block_id])
        rid = request.request_id
        self._req_num_registered[rid] = min(self._req_num_registered.get(rid, 0), first_block)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._uncache(block)
