"""The on-device sampler against a float64 numpy reference of the same semantics, on fixed random logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.runner import sampler as sm
from jaxllm.runner.sampler import SamplingInputs, neutral_inputs, processed_logits, sample
from jaxllm.runner.token_masks import all_allowed, allow_only, allowed_token_ids, ban_tokens, mask_words
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams

V = 1000  # not a multiple of 32 (mask padding) nor of the CDF block (draw padding)
S = 8
EPS = 2e-5  # reference decisions this close to a boundary are left to float32 rounding

sample_jit = jax.jit(sample)
processed_jit = jax.jit(processed_logits)


def rand_logits(seed, rows=S, vocab=V, scale=3.0):
    return np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32) * np.float32(scale)


def inputs(rows=S, vocab=V, history_len=16, **fields) -> SamplingInputs:
    inp = neutral_inputs(rows, vocab, history_len)
    fixed = {}
    for name, value in fields.items():
        ref = getattr(inp, name)
        fixed[name] = np.broadcast_to(np.asarray(value, ref.dtype), ref.shape).copy()
    return inp._replace(**fixed)


def run(fn, logits, inp):
    return jax.device_get(fn(jnp.asarray(logits), jax.tree.map(jnp.asarray, inp)))


# ---------------------------------------------------------------- the float64 reference


def ref_log_softmax(logits):
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def ref_penalised_masked(logits, inp):
    out = logits.astype(np.float64).copy()
    rows, vocab = out.shape
    for i in range(rows):
        hist, plen = inp.history[i], inp.prompt_lens[i]
        prompt, output = hist[:plen], hist[plen:]
        prompt, output = prompt[prompt >= 0], output[output >= 0]
        counts = np.bincount(output, minlength=vocab).astype(np.float64)
        seen = counts > 0
        seen[prompt] = True
        r = np.float64(inp.repetition_penalty[i])
        row = out[i]
        row[seen] = np.where(row[seen] > 0, row[seen] / r, row[seen] * r)
        row -= np.float64(inp.frequency_penalty[i]) * counts
        row -= np.float64(inp.presence_penalty[i]) * (counts > 0)
    bits = (inp.allowed[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    allowed = bits.reshape(rows, -1)[:, :vocab].astype(bool)
    return np.where(allowed, out, -np.inf)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_filter_row(z, t, min_p, top_k, top_p):
    """(kept mask, ambiguous mask) of one sampling row: tokens within EPS of a boundary are ambiguous."""
    x = z / t
    keep = np.isfinite(x)
    ambiguous = np.zeros_like(keep)
    if min_p > 0:
        p = softmax(x)
        ratio = p / p.max()
        keep &= ratio >= min_p
        ambiguous |= np.abs(ratio - min_p) < EPS
    if 0 < top_k < len(x):
        kth = np.sort(np.where(keep, x, -np.inf))[::-1][top_k - 1]
        keep &= x >= kth
    if top_p < 1:
        p = softmax(np.where(keep, x, -np.inf))
        order = np.argsort(-p, kind="stable")
        excl = np.cumsum(p[order]) - p[order]
        n = int(np.sum(excl < top_p))
        keep &= x >= x[order[n - 1]]
        ambiguous[order[np.abs(excl - top_p) < EPS]] = True
        ambiguous[order[np.abs(excl + p[order] - top_p) < EPS]] = True
    return keep, ambiguous


def ref_processed(logits, inp):
    z = ref_penalised_masked(logits, inp)
    out, amb = z.copy(), np.zeros(z.shape, bool)
    for i in range(z.shape[0]):
        if inp.temperature[i] > 0:
            keep, amb[i] = ref_filter_row(
                z[i], np.float64(inp.temperature[i]), inp.min_p[i], inp.top_k[i], np.float64(inp.top_p[i])
            )
            out[i] = np.where(keep, z[i] / np.float64(inp.temperature[i]), -np.inf)
    return out, amb


def check_processed(logits, inp, max_ambiguous=2):
    got = run(processed_jit, logits, inp)
    want, amb = ref_processed(logits, inp)
    assert amb.sum() <= max_ambiguous, "test data too close to a filter boundary"
    sure = ~amb
    np.testing.assert_array_equal(np.isfinite(got)[sure], np.isfinite(want)[sure])
    both = np.isfinite(got) & np.isfinite(want)
    np.testing.assert_allclose(got[both], want[both], rtol=1e-5, atol=1e-5)
    return got, want


# ---------------------------------------------------------------- host helpers


def test_mask_helpers():
    assert mask_words(1000) == 32 and mask_words(1024) == 32 and mask_words(1025) == 33
    rows = all_allowed(V, 3)
    assert rows.shape == (3, 32) and rows.dtype == np.uint32 and (rows == sm.ALL_ALLOWED).all()
    view = rows[1]
    assert ban_tokens(view, [0, 31, 32, 999, 31]) is view  # in place, duplicates fine
    assert set(range(V)) - set(allowed_token_ids(rows[1], V)) == {0, 31, 32, 999}
    assert len(allowed_token_ids(rows[0], V)) == V
    only = allow_only(V, [5, 64, 999])
    assert allowed_token_ids(only, V).tolist() == [5, 64, 999]
    with pytest.raises(ValueError, match="token ids"):
        ban_tokens(all_allowed(V), [V + 100])
    with pytest.raises(ValueError, match="token ids"):
        allow_only(V, [-1])


# ---------------------------------------------------------------- processed logits


def test_penalties_match_reference():
    rng = np.random.default_rng(1)
    logits = rand_logits(1)
    hist = np.full((S, 16), -1, np.int32)
    plen = np.zeros(S, np.int32)
    for i in range(S):
        n, p = rng.integers(4, 17), rng.integers(0, 4)
        hist[i, :n] = rng.choice(20, n)  # few distinct ids: repeats, counts > 1, overlap prompt/output
        hist[i, :n][rng.random(n) < 0.5] = rng.choice(20, 1)[0]
        hist[i, :n] = np.where(rng.random(n) < 0.3, np.argsort(-logits[i])[:n], hist[i, :n])  # positive logits too
        plen[i] = p
    inp = inputs(
        history=hist,
        prompt_lens=plen,
        repetition_penalty=[1.0, 1.3, 0.8, 1.0, 1.0, 1.7, 1.0, 1.0],
        frequency_penalty=[0.0, 0.0, 0.0, 0.5, 0.0, -0.4, 0.0, 0.0],
        presence_penalty=[0.0, 0.0, 0.0, 0.0, 1.2, 0.6, 0.0, 0.0],
    )  # rows 0, 6, 7 neutral: untouched even though their history is filled
    got, want = check_processed(logits, inp, max_ambiguous=0)
    np.testing.assert_array_equal(got[[0, 6, 7]], logits[[0, 6, 7]])
    assert not np.allclose(got[1:6], logits[1:6])
    # greedy follows the penalised logits
    out = run(sample_jit, logits, inp)
    np.testing.assert_array_equal(out.token_ids, want.argmax(-1))


def test_min_p_top_k_top_p_and_combination_match_reference():
    logits = rand_logits(2)
    inp = inputs(
        temperature=[0.7, 1.0, 1.3, 0.9, 1.0, 0.5, 1.0, 2.0],
        min_p=[0.1, 0.0, 0.0, 0.05, 0.0, 0.0, 0.02, 0.3],
        top_k=[0, 5, 0, 40, 1, 0, 60, 3],
        top_p=[1.0, 1.0, 0.3, 0.8, 1.0, 0.95, 0.5, 0.9],
    )
    got, want = check_processed(logits, inp)
    kept = np.isfinite(got).sum(-1)
    assert kept[4] == 1 and kept[1] == 5 and kept[7] <= 3  # top_k 1, top_k 5, top_k 3 (+min_p)
    assert (kept[[0, 2, 3, 5, 6]] < V).all()


def truncate(x, top_k, top_p, candidates):
    """top_k and top_p alone (no min_p) with a given number of candidates (few: the bisection)."""
    thr_min = jnp.full(x.shape[0], -jnp.inf)
    return sm._keep(x, sm._truncation(x, thr_min, top_k, top_p, candidates=candidates))


@pytest.mark.parametrize("scale,candidates", [(8.0, sm.TOPK_CANDIDATES), (1.0, sm.TOPK_CANDIDATES), (8.0, 4)])
def test_truncation_fast_path_and_bisection_agree(scale, candidates):
    """Peaked logits: the top-128 candidates decide top_p; flat ones (or 4 candidates) take the bisection."""
    logits = rand_logits(3, scale=scale)
    top_k = np.array([0, 50, 300, 0, 7, 0, 2, 999], np.int32)
    top_p = np.array([0.9, 1.0, 1.0, 0.6, 0.9, 0.99, 1.0, 0.75], np.float32)
    inp = inputs(temperature=1.0, top_k=top_k, top_p=top_p)
    want, amb = ref_processed(logits, inp)
    assert amb.sum() <= 2
    trunc = jax.jit(lambda x: truncate(x, jnp.asarray(top_k), jnp.asarray(top_p), candidates))
    got = np.asarray(trunc(jnp.asarray(logits)))
    np.testing.assert_array_equal(np.isfinite(got)[~amb], np.isfinite(want)[~amb])
    if candidates == sm.TOPK_CANDIDATES:
        check_processed(logits, inp)  # the whole pipeline on the same rows


def test_min_p_with_the_bisection_matches_reference():
    """top_k > the candidates sends every row to the bisection, where min_p, top_k and top_p combine."""
    logits = rand_logits(12, scale=1.5)
    inp = inputs(
        temperature=[1.0, 0.8, 1.2, 1.0, 0.0, 1.0, 0.7, 1.0],
        min_p=[0.3, 0.0, 0.1, 0.2, 0.5, 0.0, 0.05, 0.0],
        top_k=[0, 300, 200, 0, 5, 500, 0, 150],
        top_p=[0.7, 1.0, 0.9, 1.0, 0.5, 0.8, 0.95, 1.0],
    )  # row 4 is greedy: its filters are ignored
    got, want = check_processed(logits, inp)
    np.testing.assert_array_equal(got[4], logits[4])
    kept = np.isfinite(got).sum(-1)
    assert kept[1] == 300 and kept[7] == 150 and (kept[[0, 2, 3, 5, 6]] < V).all()


def test_truncation_ties_keep_every_equal_value():
    x = np.array([[3.0, 1.0, 3.0, 2.0, 3.0, -1.0, 2.0, 0.0]], np.float32)
    trunc = jax.jit(truncate, static_argnums=3)
    for c in (8, 2):  # candidates / bisection
        got = np.asarray(trunc(jnp.asarray(x), jnp.array([2]), jnp.array([1.0]), c))
        assert np.isfinite(got[0]).tolist() == [True, False, True, False, True, False, False, False]
        got = np.asarray(trunc(jnp.asarray(x), jnp.array([4]), jnp.array([1.0]), c))
        assert np.isfinite(got[0]).tolist() == [True, False, True, True, True, False, True, False]
        got = np.asarray(trunc(jnp.asarray(x), jnp.array([0]), jnp.array([0.01]), c))
        assert np.isfinite(got[0]).sum() == 3  # all three maxima


def test_bitmask_excludes_tokens_and_samples_stay_inside():
    rng = np.random.default_rng(4)
    logits = rand_logits(4, scale=4.0)
    allowed = all_allowed(V, S)
    ban_tokens(allowed[0], np.argsort(-logits[0])[:10])  # the 10 best tokens banned
    allowed[1] = allow_only(V, [3, 500, 998, 999])
    allowed[2] = allow_only(V, rng.choice(V, 200, replace=False))
    allowed[3] = rng.integers(0, 2**32, 32, dtype=np.uint32)
    ban_tokens(allowed[5], np.argsort(-logits[5])[:3])  # greedy row
    temperature = np.array([1.0, 1.0, 1.5, 0.8, 1.0, 0.0, 1.0, 1.0], np.float32)
    inp = inputs(allowed=allowed, temperature=temperature, top_p=[1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0])
    got, _ = check_processed(logits, inp)
    for i in range(S):
        assert set(np.flatnonzero(np.isfinite(got[i]))) <= set(allowed_token_ids(allowed[i], V))
    assert np.isfinite(got[1]).sum() == 4
    steps = jnp.arange(200)
    many = jax.jit(
        jax.vmap(
            lambda s: sample(
                jnp.asarray(logits), jax.tree.map(jnp.asarray, inp._replace(steps=jnp.full(S, s, jnp.int32)))
            )
        )
    )(steps)
    toks = np.asarray(many.token_ids)  # [200, S]
    for i in range(S):
        assert set(toks[:, i].tolist()) <= set(allowed_token_ids(allowed[i], V)), i
    assert len(set(toks[:, 1].tolist())) > 1
    assert (toks[:, 5] == np.argsort(-logits[5])[3]).all()  # greedy: best allowed


# ---------------------------------------------------------------- sampled tokens and logprobs


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = rand_logits(5)
    inp = inputs(num_logprobs=[-1, 0, 5, 20, -1, -1, 1, -1])
    out = run(sample_jit, logits, inp)
    raw = ref_log_softmax(logits)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    np.testing.assert_allclose(out.logprobs, raw.max(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.ranks[[1, 2, 3, 6]], 1)
    order = np.argsort(-raw, axis=-1)[:, :MAX_LOGPROBS]
    for i in (1, 2, 3, 6):
        np.testing.assert_array_equal(out.top_token_ids[i], order[i])
        np.testing.assert_allclose(out.top_logprobs[i], raw[i, order[i]], rtol=1e-5, atol=1e-5)
    # nobody asks for logprobs: the same tokens, and no log-softmax computed (vLLM's logprobs are on request)
    out2 = run(sample_jit, logits, inputs())
    np.testing.assert_array_equal(out2.token_ids, out.token_ids)
    np.testing.assert_array_equal(out2.logprobs, 0)


def test_sampled_token_logprob_and_rank():
    logits = rand_logits(6, scale=1.0)
    inp = inputs(temperature=1.5, seeds=np.arange(S), num_logprobs=2)
    out = run(sample_jit, logits, inp)
    raw = ref_log_softmax(logits)
    rows = np.arange(S)
    np.testing.assert_allclose(out.logprobs, raw[rows, out.token_ids], rtol=1e-5, atol=1e-5)
    ranks = 1 + (raw > raw[rows, out.token_ids][:, None]).sum(-1)
    np.testing.assert_array_equal(out.ranks, ranks)
    assert (out.ranks > 1).any()  # flat logits at temperature 1.5: not always the argmax
    # penalties, temperature and mask never change the raw logprobs
    history = np.tile(np.arange(16, dtype=np.int32), (S, 1))
    pen = inp._replace(repetition_penalty=np.full(S, 2.0, np.float32), history=history)
    out_pen = run(sample_jit, logits, pen)
    np.testing.assert_allclose(out_pen.logprobs, raw[rows, out_pen.token_ids], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_pen.top_logprobs, out.top_logprobs, rtol=1e-6)


def test_seed_reproducible_whatever_the_batch():
    logits = rand_logits(7, rows=1, scale=1.0)[0]
    params = dict(temperature=0.9, top_p=0.9, top_k=100, min_p=0.01, seeds=1234, steps=17)
    other = rand_logits(8, rows=8, scale=2.0)
    # row 0 of a batch of 2, row 5 of a batch of 8, alone in a batch of 1, among greedy and other rows
    b2 = inputs(rows=2, temperature=[0.9, 0.0])
    b8 = inputs(
        rows=8,
        temperature=[1.0, 0.0, 0.5, 1.0, 0.0, 0.9, 2.0, 0.0],
        seeds=np.arange(8) + 7,
        top_k=[0, 0, 5, 0, 0, 100, 0, 0],
    )
    for name, value in params.items():
        getattr(b2, name)[0] = value
        getattr(b8, name)[5] = value
    x2 = other[:2].copy()
    x2[0] = logits
    x8 = other.copy()
    x8[5] = logits
    t2 = run(sample_jit, x2, b2).token_ids[0]
    t8 = run(sample_jit, x8, b8).token_ids[5]
    t1 = run(sample_jit, logits[None], inputs(rows=1, **params)).token_ids[0]
    assert t2 == t8 == t1
    # different steps and different seeds give different tokens (flat logits: almost surely)
    steps = run(sample_jit, np.tile(logits, (S, 1)), inputs(**{**params, "steps": np.arange(S)})).token_ids
    seeds = run(sample_jit, np.tile(logits, (S, 1)), inputs(**{**params, "seeds": np.arange(S)})).token_ids
    same = run(sample_jit, np.tile(logits, (S, 1)), inputs(**params)).token_ids
    assert len(set(steps.tolist())) >= 4 and len(set(seeds.tolist())) >= 4
    assert (same == t1).all()


def test_empirical_frequencies_match_reference_distribution():
    vocab = 40
    logits = rand_logits(9, rows=2, vocab=vocab, scale=1.5)
    hist = np.full((2, 8), -1, np.int32)
    hist[1, :6] = [0, 1, 2, 2, 3, 3]
    inp = inputs(
        rows=2,
        vocab=vocab,
        history_len=8,
        temperature=[0.8, 1.2],
        top_p=[0.9, 0.8],
        top_k=[0, 15],
        min_p=[0.0, 0.05],
        repetition_penalty=[1.0, 1.5],
        frequency_penalty=[0.0, 0.3],
        history=hist,
        prompt_lens=[0, 2],
        seeds=[11, 12],
    )
    want, amb = ref_processed(logits, inp)
    assert not amb.any()
    n = 4000
    draw = jax.jit(
        jax.vmap(
            lambda s: (
                sample(
                    jnp.asarray(logits), jax.tree.map(jnp.asarray, inp._replace(steps=jnp.full(2, s, jnp.int32)))
                ).token_ids
            )
        )
    )
    toks = np.asarray(draw(jnp.arange(n)))  # [n, 2]
    for i in range(2):
        p = softmax(want[i])
        freq = np.bincount(toks[:, i], minlength=vocab) / n
        assert (freq[p == 0] == 0).all()  # never outside the kept set
        sigma = np.sqrt(p * (1 - p) / n)
        assert (np.abs(freq - p) <= 4.5 * sigma + 1e-9).all(), (freq, p)
        chi2 = ((freq - p) ** 2 / np.where(p > 0, p, 1)).sum() * n
        assert chi2 < 3 * (p > 0).sum() + 20


def test_all_rows_neutral_skip_optional_outputs():
    logits = rand_logits(10)
    out = run(sample_jit, logits, inputs())
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    assert out.top_token_ids.shape == (S, MAX_LOGPROBS) and out.top_logprobs.shape == (S, MAX_LOGPROBS)
    assert out.token_ids.dtype == np.int32 and out.ranks.dtype == np.int32 and out.logprobs.dtype == np.float32


def test_tiny_vocab_pads_top_logprobs():
    logits = rand_logits(11, rows=2, vocab=7)
    out = run(sample_jit, logits, inputs(rows=2, vocab=7, num_logprobs=[5, -1], temperature=[1.0, 0.0]))
    assert out.top_token_ids.shape == (2, MAX_LOGPROBS)
    assert (out.top_token_ids[0, 7:] == -1).all() and np.isneginf(out.top_logprobs[0, 7:]).all()
    assert sorted(out.top_token_ids[0, :7].tolist()) == list(range(7))


def test_logit_bias_moves_the_greedy_token_and_keeps_raw_logprobs():
    logits = rand_logits(11)
    ids = np.full((S, sm.MAX_LOGIT_BIAS), -1, np.int32)
    values = np.zeros((S, sm.MAX_LOGIT_BIAS), np.float32)
    top = logits.argmax(-1)
    ids[0, :2], values[0, :2] = [top[0], 7], [-100.0, 100.0]  # the argmax banned, token 7 pushed up
    ids[1, 0], values[1, 0] = top[1], 5.0  # the argmax pushed further: unchanged
    out = run(sample_jit, logits, inputs(bias_ids=ids, bias_values=values, num_logprobs=0))
    assert out.token_ids[0] == 7 and out.token_ids[1] == top[1]
    np.testing.assert_array_equal(out.token_ids[2:], top[2:])  # rows without a bias
    raw = ref_log_softmax(logits)
    np.testing.assert_allclose(out.logprobs[0], raw[0, 7], rtol=1e-5, atol=1e-5)  # logprobs stay raw


@pytest.mark.parametrize(
    "bias",
    [{"x": 1.0}, {-1: 1.0}, {3: 101}, {3: "1"}, [(3, 1.0)], {i: 1.0 for i in range(sm.MAX_LOGIT_BIAS + 1)}],
)
def test_logit_bias_validation(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_json_keys():
    assert SamplingParams(logit_bias={"42": -100, 7: 2}).logit_bias == {42: -100.0, 7: 2.0}
