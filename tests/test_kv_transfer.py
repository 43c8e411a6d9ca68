"""KV connectors in one process: stable block keys, the block mover, offloading to host memory, shared storage,
and P/D transfer between two engines, with injected faults. Every connector's output must equal an engine
without one, and every block must come back to the pool. (Servers and the router: tests/test_disaggregated.py.)
"""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import KVTransferConfig
from jaxllm.engine.block_hash import root_hash
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.model import KVCache
from jaxllm.parallel.mesh import kv_cache_sharding, make_mesh
from jaxllm.request import Request
from jaxllm.runner.compilations import compilation_count
from jaxllm.runner.kv_blocks import KVBlockMover
from tests.conftest import TEST_ENGINE, kv_bytes

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPTS = [
    "The history of the Roman empire is long and complicated. " * 10,
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. " * 8,
    "A list of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47. " * 5,
]


def _engine(num_blocks: int = 128, **kwargs) -> LLM:
    return LLM(**TEST_ENGINE, kv_cache_memory_bytes=kv_bytes(num_blocks), **kwargs)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _no_blocks_in_use(llm: LLM) -> bool:
    stats = llm.engine.stats()
    return stats["num_free_blocks"] == stats["num_blocks"]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy tokens of an engine without a connector."""
    return _tokens(_engine().generate(PROMPTS, GREEDY, use_tqdm=False))


# ---- keys -----------------------------------------------------------------------------------------------------

HASHES_SCRIPT = """
import sys
from jaxllm.engine.block_hash import root_hash
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams
kv = KVCacheManager(8, 4, root=root_hash(sys.argv[1]))
request = Request("r", list(range(100, 113)), SamplingParams())
print(",".join(h.hex() for h in kv.block_hashes(request, 3)))
"""


def _hashes_here(scope: str) -> str:
    kv = KVCacheManager(8, 4, root=root_hash(scope))
    request = Request("r", list(range(100, 113)), SamplingParams())
    return ",".join(h.hex() for h in kv.block_hashes(request, 3))


def test_block_keys_are_the_same_in_another_process_and_differ_by_scope():
    theirs = subprocess.run(
        [sys.executable, "-c", HASHES_SCRIPT, "scope-a"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert theirs == _hashes_here("scope-a")
    assert len(theirs.split(",")) == 3
    assert _hashes_here("scope-b").split(",")[0] != theirs.split(",")[0]


# ---- the block mover ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_block_mover_gathers_and_scatters_whole_blocks(tp):
    """Random K/V in used blocks, NaN in the rest: a gather returns exactly the asked blocks, a scatter writes
    exactly them (sharded over KV heads with tp=2), padding goes to the scratch block only."""
    mesh = make_mesh(tp)
    rng = np.random.default_rng(tp)
    shape = (2, 12, 4, 4, 8)  # layers, blocks, block size, KV heads, head dim
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[:, 7:], v[:, 7:] = np.nan, np.nan  # unused blocks
    cache = KVCache(*(jax.device_put(a, kv_cache_sharding(mesh)) for a in (k, v)))
    runner = SimpleNamespace(cache=cache, mesh=mesh)
    mover = KVBlockMover(runner, max_blocks=4)
    mover.warm_up()
    assert mover.buckets == [1, 2, 4]
    before = compilation_count()
    got_k, got_v = mover.gather([5, 2, 3])
    np.testing.assert_array_equal(got_k, k[:, [5, 2, 3]])
    np.testing.assert_array_equal(got_v, v[:, [5, 2, 3]])
    big_k, _ = mover.gather([1, 2, 3, 4, 5, 6])  # more than the largest bucket: in chunks
    np.testing.assert_array_equal(big_k, k[:, 1:7])
    new_k = rng.standard_normal((2, 3, 4, 4, 8)).astype(np.float32)
    mover.scatter([8, 9, 10], new_k, -new_k)
    after_k, after_v = np.asarray(runner.cache.k), np.asarray(runner.cache.v)
    np.testing.assert_array_equal(after_k[:, 8:11], new_k)
    np.testing.assert_array_equal(after_v[:, 8:11], -new_k)
    np.testing.assert_array_equal(after_k[:, 1:7], k[:, 1:7])  # nothing else moved (block 0 took the padding)
    assert np.isnan(after_k[:, 11]).all()
    assert runner.cache.k.sharding == kv_cache_sharding(mesh)
    assert compilation_count() == before


# ---- configuration --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        ({"kv_connector": "NixlConnector"}, "unknown kv_connector 'NixlConnector'"),
        ({"kv_connector": "OffloadingConnector", "kv_role": "kv_consumer"}, "takes kv_role kv_both"),
        ({"kv_connector": "TransferConnector", "kv_role": "decoder"}, "kv_role must be one of"),
        ({"kv_connector": "TransferConnector", "kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
        ({"kv_role": "kv_both"}, "needs 'kv_connector'"),
        ('{"kv_connector": ', "not valid JSON"),
    ],
)
def test_bad_kv_transfer_config_is_refused_before_loading(config, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse(config)


def test_bad_connector_settings_fail_at_start_up(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    cases = [
        ({"kv_connector": "SharedStorageConnector"}, 'needs {"shared_storage_path"'),
        (
            {
                "kv_connector": "SharedStorageConnector",
                "kv_connector_extra_config": {"shared_storage_path": str(read_only / "x")},
            },
            "is not writable",
        ),
        ({"kv_connector": "OffloadingConnector"}, "needs --kv-offloading-size"),
    ]
    if os.geteuid() == 0:  # root writes anywhere
        cases.pop(1)
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            _engine(kv_transfer_config=config)
    with pytest.raises(ValueError, match="more than this machine's"):
        _engine(kv_offloading_size=1 << 20)


# ---- offloading -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_offloading_brings_evicted_prefixes_back_from_host_memory(async_scheduling):
    """A device pool too small for the three long prompts: each evicts the one before, whose blocks go to host
    memory and come back for its second run, with the same tokens; with a step in flight too (the connector's
    work rides on each step in every step loop)."""
    llm = _engine(num_blocks=33, kv_offloading_size=0.05, async_scheduling=async_scheduling)
    tokenizer = llm.get_tokenizer()
    long_prompts = [{"prompt_token_ids": tokenizer.encode(p * 4)[:360]} for p in PROMPTS]  # 23 blocks each
    expected = _tokens(_engine().generate(long_prompts, GREEDY, use_tqdm=False))
    first = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in long_prompts]
    again = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in long_prompts]
    assert _tokens(first) == expected
    assert _tokens(again) == expected
    stats = llm.engine.stats()
    assert stats["kv_transfer_save_count"] > 0  # evicted blocks went out
    assert stats["external_prefix_cache_hits"] >= 16 * 10 * len(PROMPTS)  # and came back
    assert all(o.num_cached_tokens >= 16 * 10 for o in again)
    assert _no_blocks_in_use(llm)


# ---- shared storage -------------------------------------------------------------------------------------------


def _storage(path, **extra) -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
        **extra,
    }


@pytest.fixture(scope="module")
def storage_dir(tmp_path_factory, reference):
    """A folder the first engine filled with the prompts' blocks."""
    path = tmp_path_factory.mktemp("kv")
    writer = _engine(kv_transfer_config=_storage(path))
    assert _tokens(writer.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    writer.engine.kv_connector.worker.flush()
    return path


def _block_files(path) -> list:
    return sorted(p for p in path.rglob("*.npz"))


def test_shared_storage_second_engine_reuses_the_first_ones_kv(storage_dir, reference):
    reader = _engine(kv_transfer_config=_storage(storage_dir))
    before = compilation_count()
    outputs = reader.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert compilation_count() == before  # loads and saves are compiled at start-up
    assert _tokens(outputs) == reference
    stats = reader.engine.stats()
    full_blocks = sum((len(o.prompt_token_ids) - 1) // 16 for o in outputs)
    assert stats["external_prefix_cache_hits"] == 16 * full_blocks
    assert [o.num_cached_tokens for o in outputs] == [(len(o.prompt_token_ids) - 1) // 16 * 16 for o in outputs]
    assert _no_blocks_in_use(reader)
    metrics = {(m.name, tuple(sorted(m.labels.items()))): m for m in reader.get_metrics()}
    hits = [m for (name, _), m in metrics.items() if name == "jaxllm:external_prefix_cache_hits"]
    assert [m.value for m in hits] == [16 * full_blocks]
    loads = [
        m
        for (name, labels), m in metrics.items()
        if name == "jaxllm:kv_transfer_bytes" and ("direction", "load") in labels
    ]
    assert loads and loads[0].value == stats["kv_transfer_load_bytes"] > 0


def test_shared_storage_corrupt_block_recomputes_or_fails(storage_dir, reference, tmp_path):
    import shutil

    corrupt = tmp_path / "kv"
    shutil.copytree(storage_dir, corrupt)
    reader = _engine(kv_transfer_config=_storage(corrupt))
    hashes = reader.engine.kv.block_hashes(Request("x", reader.get_tokenizer().encode(PROMPTS[0]), GREEDY), 5)
    files = reader.engine.kv_connector.worker.files
    with open(files.path((0, hashes[2])), "r+b") as f:  # the third block: flip bytes in the middle
        f.seek(200)
        f.write(b"\x00\xff" * 64)
    os.remove(files.path((0, hashes[4])))  # and a later one goes missing (never reached: the run ends at block 2)
    out = reader.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[0]
    assert out.num_cached_tokens == 2 * 16  # the two good blocks, then computed
    assert reader.engine.stats()["kv_transfer_failures"] == {"corrupt": 1}

    strict = _engine(kv_transfer_config=_storage(corrupt, kv_load_failure_policy="fail"))
    bad, good = strict.generate([PROMPTS[0], PROMPTS[1]], GREEDY, use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error"
    assert "is unreadable" in bad.error and "CRC" in bad.error
    assert good.outputs[0].token_ids == reference[1]  # the other request is untouched
    assert _no_blocks_in_use(strict)


# ---- P/D transfer ---------------------------------------------------------------------------------------------


def _producer_params(producer: LLM, prompt: str) -> dict:
    remote = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    out = producer.generate([prompt], remote, use_tqdm=False)[0]
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def _decode(consumer: LLM, prompts: list[str], params: list[dict]):
    sampling = [SamplingParams(max_tokens=8, temperature=0, extra_args={"kv_transfer_params": p}) for p in params]
    return consumer.generate(prompts, sampling, use_tqdm=False)


@pytest.fixture(scope="module")
def pd():
    transfer = {"kv_connector": "TransferConnector"}
    # the producer schedules asynchronously (its offers follow each applied step), the consumer one step at a time
    producer = _engine(kv_transfer_config={**transfer, "kv_role": "kv_producer"}, async_scheduling=True)
    consumer = _engine(
        kv_transfer_config={
            **transfer,
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"pull_timeout_seconds": 3},
        }
    )
    return producer, consumer


def test_transfer_consumer_decodes_from_the_producers_kv(pd, reference):
    producer, consumer = pd
    params = [_producer_params(producer, p) for p in PROMPTS]
    assert _no_blocks_in_use(producer)  # the offer holds a copy: the device blocks are back
    assert producer.engine.stats()["kv_transfer_send_count"] == len(PROMPTS)
    hits = consumer.engine.stats()["external_prefix_cache_hits"]
    before = compilation_count()
    outputs = _decode(consumer, PROMPTS, params)
    assert compilation_count() == before
    assert _tokens(outputs) == reference
    received = consumer.engine.stats()["external_prefix_cache_hits"] - hits
    assert received == sum(len(o.prompt_token_ids) - 1 for o in outputs)  # only the last prompt token computed
    assert [o.num_cached_tokens for o in outputs] == [len(o.prompt_token_ids) - 1 for o in outputs]
    assert _no_blocks_in_use(consumer)


def test_transfer_that_never_completes_is_recomputed_within_its_deadline(pd, reference):
    producer, consumer = pd
    params = _producer_params(producer, PROMPTS[0])
    lost = {**params, "remote_transfer_id": params["remote_transfer_id"] ^ 1}  # an id nobody offers
    started = time.monotonic()
    out = _decode(consumer, [PROMPTS[0]], [lost])[0]
    assert time.monotonic() - started < 3 + 5
    assert out.outputs[0].token_ids == reference[0]
    assert consumer.engine.stats()["kv_transfer_failures"].get("timeout", 0) >= 1
    assert _no_blocks_in_use(consumer)
    # the real offer is still there (one pull each): the next request takes it
    assert _tokens(_decode(consumer, [PROMPTS[0]], [params])) == [reference[0]]


def test_transfer_from_a_producer_that_is_gone_fails_at_once_and_recomputes(pd, reference):
    from jaxllm.bench.server_process import free_port

    producer, consumer = pd
    gone = {**_producer_params(producer, PROMPTS[2]), "remote_address": f"127.0.0.1:{free_port()}"}
    started = time.monotonic()
    out = _decode(consumer, [PROMPTS[2]], [gone])[0]
    assert time.monotonic() - started < 3  # not the 3 s pull deadline: nobody listens there
    assert out.outputs[0].token_ids == reference[2]
    assert consumer.engine.stats()["kv_transfer_failures"].get("unreachable", 0) >= 1
    assert _no_blocks_in_use(consumer)


def test_transfer_from_a_different_scope_or_malformed_params_is_refused_as_it_arrives(pd, reference):
    producer, consumer = pd
    params = _producer_params(producer, PROMPTS[1])
    other = {**params, "kv_scope": {**params["kv_scope"], "block_size": 32, "dtype": "bfloat16"}}
    with pytest.raises(ValueError, match="dtype: ours .float32., theirs .bfloat16.*block_size: ours 16, theirs 32"):
        _decode(consumer, PROMPTS[1:2], [other])
    with pytest.raises(ValueError, match="remote_num_blocks must be a non-negative integer"):
        _decode(consumer, PROMPTS[1:2], [{**params, "remote_num_blocks": "nine"}])
    assert _tokens(_decode(consumer, PROMPTS[1:2], [params])) == [reference[1]]
    assert _no_blocks_in_use(consumer)


def test_transfer_failure_policy_fail_ends_the_request_with_an_error(pd, reference):
    producer, _ = pd
    strict = _engine(
        kv_transfer_config={
            "kv_connector": "TransferConnector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"pull_timeout_seconds": 1},
        }
    )
    params = _producer_params(producer, PROMPTS[2])
    lost = {**params, "remote_transfer_id": params["remote_transfer_id"] ^ 1}
    bad, good = strict.generate(
        [PROMPTS[2], PROMPTS[0]],
        [SamplingParams(max_tokens=8, temperature=0, extra_args={"kv_transfer_params": lost}), GREEDY],
        use_tqdm=False,
    )
    assert bad.outputs[0].finish_reason == "error" and "timed out waiting for KV" in bad.error
    assert good.outputs[0].token_ids == reference[0]
    assert _no_blocks_in_use(strict)


def test_abort_while_waiting_for_remote_kv_returns_the_blocks_once_the_pull_ends(pd):
    producer, consumer = pd
    params = _producer_params(producer, PROMPTS[0])
    lost = {**params, "remote_transfer_id": params["remote_transfer_id"] ^ 1}
    engine = consumer.engine
    engine.add_request(
        "aborted", consumer.get_tokenizer().encode(PROMPTS[0]), SamplingParams(extra_args={"kv_transfer_params": lost})
    )
    engine.step()
    assert engine.stats()["num_waiting_for_remote_kvs"] == 1
    engine.abort_request("aborted")
    assert not _no_blocks_in_use(consumer)  # held: the pull may still write into them
    assert engine.has_unfinished_requests()  # so the engine keeps polling it
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
    assert _no_blocks_in_use(consumer)


def test_storage_saves_only_verified_tokens_and_prompt_logprobs_never_load(tmp_path, reference):
    """A speculating producer saves its blocks (drafts in flight never reach a file): a reader that loads them
    gives the reference tokens. A request scoring its prompt computes every position and loads nothing."""
    speculating = _engine(
        kv_transfer_config=_storage(tmp_path),
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
    )
    written = speculating.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    assert speculating.engine.stats()["spec_decode_num_draft_tokens"] > 0
    speculating.engine.kv_connector.worker.flush()
    continued = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids} for o in written]
    expected = _tokens(_engine().generate(continued, GREEDY, use_tqdm=False))
    reader = _engine(kv_transfer_config=_storage(tmp_path))
    assert _tokens(reader.generate(continued, GREEDY, use_tqdm=False)) == expected
    # every full block of the prompts and of the speculated outputs was on disk, and right
    full_blocks = sum((len(c["prompt_token_ids"]) - 1) // 16 for c in continued)
    assert reader.engine.stats()["external_prefix_cache_hits"] == 16 * full_blocks
    reader.engine.reset_prefix_cache()
    hits = reader.engine.stats()["external_prefix_cache_hits"]
    scored = reader.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False
    )
    assert reader.engine.stats()["external_prefix_cache_hits"] == hits
    assert scored[0].num_cached_tokens == 0 and len(scored[0].prompt_logprobs) == len(scored[0].prompt_token_ids)


def test_transfer_with_tensor_parallelism_moves_each_shards_heads(reference):
    """tp=3 over 3 host devices: the cache is sharded over the KV heads, so is each gathered and pulled block."""
    sharded = dict(tensor_parallel_size=3, num_blocks=64)
    producer = _engine(**sharded, kv_transfer_config={"kv_connector": "TransferConnector", "kv_role": "kv_producer"})
    consumer = _engine(**sharded, kv_transfer_config={"kv_connector": "TransferConnector", "kv_role": "kv_consumer"})
    out = _decode(consumer, PROMPTS[:1], [_producer_params(producer, PROMPTS[0])])[0]
    assert out.outputs[0].token_ids == reference[0]
    assert out.num_cached_tokens == len(out.prompt_token_ids) - 1
    assert out.kv_transfer_params is None and _no_blocks_in_use(consumer) and _no_blocks_in_use(producer)
