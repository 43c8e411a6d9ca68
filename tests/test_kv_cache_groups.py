"""The hybrid KV cache manager on its own (pure Python): layers grouped by attention kind, windowed groups that free
the blocks leaving their window, and prefix hits that need only the window before the hit point."""

import pytest

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.kv_cache_groups import SCRATCH_BLOCK, KVCacheGroups
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams

BS = 4


def gemma3_windows(num_layers: int, window: int) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_layers_group_by_kind_in_groups_of_the_fewest_layers():
    """Gemma-3-1B: 26 layers, 4 global; vLLM's grouping: groups of 4 layers, one global group and six local ones
    (the last holds 2), so a block is 4 layers' K/V instead of 26."""
    groups = KVCacheGroups.plan(gemma3_windows(26, 512), max_model_len=8192)
    assert groups.slots == 4 and groups.windows == (512,) * 6 + (None,)
    globals_ = [i for i in range(26) if (i + 1) % 6 == 0]
    assert {groups.layer_groups[i] for i in globals_} == {6}
    assert sorted(groups.layer_slots[i] for i in globals_) == [0, 1, 2, 3]
    places = {(groups.layer_groups[i], groups.layer_slots[i]) for i in range(26)}
    assert len(places) == 26  # no two layers share a slot of a group
    # Gemma 2's alternation: two groups of half the layers each
    gemma2 = KVCacheGroups.plan([4096 if i % 2 == 0 else None for i in range(26)], max_model_len=8192)
    assert (gemma2.slots, gemma2.windows) == (13, (4096, None))


def test_uniform_layouts():
    """A window covering max_model_len is full attention; one kind is one group; the manager off is one group."""
    assert KVCacheGroups.plan(gemma3_windows(12, 512), max_model_len=512) == KVCacheGroups.uniform(12)
    assert KVCacheGroups.plan([8] * 3, max_model_len=64) == KVCacheGroups.uniform(3, 8)
    assert KVCacheGroups.plan(gemma3_windows(12, 8), max_model_len=64, hybrid=False) == KVCacheGroups.uniform(12)
    assert not KVCacheGroups.uniform(12).is_hybrid and KVCacheGroups.uniform(3, 8).is_hybrid


def make(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=1000))


def held(kv: KVCacheManager, request: Request) -> list[int]:
    return [sum(b != SCRATCH_BLOCK for b in table) for table in kv.block_tables(request.request_id)]


def bound(window: int, tokens: int) -> int:
    """vLLM's: the blocks a windowed group holds at most for a request computing `tokens` this step."""
    return -(-(window - 1 + tokens) // BS) + 1


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_a_windowed_group_holds_its_window_and_returns_the_rest(chunk):
    """A request prefilled in chunks, then decoding: the full group grows with the context, the windowed one stays
    within vLLM's bound and hands every block that leaves the window back; after it finishes every block is free."""
    window = 6
    kv = KVCacheManager(64, BS, windows=(window, None))
    request = make("r", list(range(40)))
    while request.num_computed_tokens < 60:
        n = min(chunk, 60 - request.num_computed_tokens)
        assert kv.allocate_slots(request, n)
        sliding, full = held(kv, request)
        assert sliding <= bound(window, n)
        assert full == -(-(request.num_computed_tokens + n) // BS)
        table = kv.block_tables("r")[0]
        first_needed = max(request.num_computed_tokens - window + 1, 0) // BS  # the oldest key still attended
        assert all(b != SCRATCH_BLOCK for b in table[first_needed:])
        request.num_computed_tokens += n
        if request.num_computed_tokens >= request.num_tokens:
            request.output_token_ids.append(7)
    assert kv.num_free_blocks < kv.num_usable_blocks
    kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_windowed_groups_admit_more_sequences():
    """The same memory: a uniform block is all 6 layers' K/V, a hybrid one a single layer's (one slot), and a
    windowed group keeps only its window, so a 5:1 model holds about 4x the 128-token sequences."""
    hybrid = KVCacheManager(6 * 400, BS, windows=(8,) * 5 + (None,))
    uniform = KVCacheManager(400, BS)
    admitted = {}
    for name, kv in (("hybrid", hybrid), ("uniform", uniform)):
        count = 0
        while True:  # sequences prefilled in 8-token chunks, as the engine's budget would, until one does not fit
            request = make(f"{name}{count}", [count] * 128)
            while request.num_computed_tokens < 128 and kv.allocate_slots(request, 8):
                request.num_computed_tokens += 8
            if request.num_computed_tokens < 128:
                break
            count += 1
        admitted[name] = count
    assert admitted["uniform"] == 399 // 32
    assert admitted["hybrid"] >= 3.5 * admitted["uniform"]


def test_a_windowed_hit_needs_only_the_blocks_inside_the_window():
    """vLLM's rule: after a hit the next token attends the last window-1 keys, so a windowed group needs only the
    blocks holding them; blocks lost before them do not cut the hit short (a full group would need them all)."""
    window, tokens = 6, list(range(30))
    needed = -(-(window - 1) // BS)  # blocks holding the window before a hit at a block boundary
    for windows in ((window,), (window, None)):
        kv = KVCacheManager(64, BS, windows=windows)
        first = make("first", tokens)
        assert kv.allocate_slots(first, 30)
        first.num_computed_tokens = 30
        for table in kv.block_tables("first"):
            kv._uncache(kv.blocks[table[0]])  # the first block of every group is evicted
        kv.free(first)
        hit = kv.get_computed_blocks(make("again", tokens))
        if windows == (window,):
            assert hit.num_blocks == 7  # 28 of 29 tokens: every full block before the last token
            assert hit.block_ids[0][: 7 - needed] == [SCRATCH_BLOCK] * (7 - needed)
            assert SCRATCH_BLOCK not in hit.block_ids[0][7 - needed :]
        else:  # the full-attention group lost its first block: nothing can be reused
            assert hit.num_blocks == 0


def test_a_hit_settles_on_a_length_every_group_can_resume_from():
    """The windowed group misses a block in its window at the longest hit: a shorter hit, whose window it does
    hold, is taken for every group."""
    window, tokens = 5, list(range(33))
    kv = KVCacheManager(64, BS, windows=(window, None))
    first = make("first", tokens)
    assert kv.allocate_slots(first, 33)
    first.num_computed_tokens = 33
    table = kv.block_tables("first")[0]
    kv._uncache(kv.blocks[table[7]])  # the windowed group's block 7 (tokens 28-31) is not reusable
    hit = kv.get_computed_blocks(make("again", tokens))
    assert hit.num_blocks == 7  # the longest hit, 8 blocks, would need block 7; 7 blocks need only 5 and 6
    assert len(hit.block_ids[1]) == 7 and SCRATCH_BLOCK not in hit.block_ids[1]
    again = make("again", tokens)
    assert kv.allocate_slots(again, 33 - 28, hit)
    assert kv.block_tables("again")[1][:7] == kv.block_tables("first")[1][:7]


def test_a_pipeline_stage_keeps_every_group_with_its_own_slots():
    """Gemma-3-1B's groups over two stages of 13 layers: every group's block tables stay (the scheduler's), each
    stage's layers of a group take slots from 0 in its own cache."""
    groups = KVCacheGroups.plan(gemma3_windows(26, 512), max_model_len=8192)
    for start, end in ((0, 13), (13, 26)):
        stage = groups.stage(start, end)
        assert stage.windows == groups.windows and stage.layer_groups == groups.layer_groups[start:end]
        places = set(zip(stage.layer_groups, stage.layer_slots, strict=True))
        assert len(places) == end - start and stage.slots == max(stage.layer_slots) + 1 <= groups.slots
    assert KVCacheGroups.uniform(6).stage(2, 5) == KVCacheGroups.uniform(3)
