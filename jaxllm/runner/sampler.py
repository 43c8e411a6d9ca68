"""On-device sampling for one engine step.

`sample(logits, inputs)` is a pure, jit-able function the engine calls once per step inside
its compiled step, after the model's logits. Rows are sequences; padding rows carry neutral
values (temperature 0, no penalties, all tokens allowed, no logprobs).

Per row, in this order (vLLM's semantics):

a. raw = log_softmax(logits): every logprob the sampler returns is a raw one.
a'. logit_bias: each row's (token, bias) pairs added to its logits, before every other processor.
b. penalties: repetition_penalty r on tokens present in the prompt or the output
   (logit > 0 ? logit / r : logit * r), then logit -= frequency_penalty * count and
   logit -= presence_penalty * (count > 0), counts over the output tokens only.
c. the `allowed` bitmask: a token whose bit is clear gets -inf.
d. temperature 0: greedy, the argmax of those logits (lowest id on ties).
e. otherwise: / temperature → min_p (drop p < min_p * max p) → top_k (keep values >= the
   k-th largest) → top_p (keep the smallest set of most probable tokens whose mass,
   renormalised after the previous filters, reaches top_p; ties with the last kept token
   kept too) → one categorical draw, keyed by fold_in(key(seed), step): the same
   (seed, step, logits) gives the same token whatever the batch around the row.
f. when some row asks for logprobs: logprob of the sampled token, its rank, and the top MAX_LOGPROBS raw
   logprobs (else zeros, as vLLM computes logprobs only on request); on rows that score a given token
   (`target_ids`: prompt_logprobs), that token's raw logprob and rank.

Every optional stage is behind a `lax.cond` on a device-side `any(...)` of its inputs, so a step
where no row uses it skips its cost (the scatter of the penalties, the mask unpacking, the top_k
/ top_p search, the whole draw when every row is greedy, the log-softmax and top logprobs); a
batch of greedy rows that no stage touches takes the argmax alone (a skipped stage's cond still
copies the logits); filters of greedy rows are ignored. min_p, top_k and top_p become one
threshold per row, applied once, inside the draw. Nothing here sorts the vocabulary: XLA's CPU
sort of [64, 49152] takes close to a second. The top_k / top_p thresholds come from the top
TOPK_CANDIDATES logits when those decide every row (always for top_k <= 128; for top_p when they
hold the nucleus, the usual case with a peaked distribution), else from an exact bitwise
bisection over the float order (up to 64 passes over the logits). argmax and the top logprobs go
by blocks of the vocabulary (XLA CPU's argmax and top_k over a whole row are several times
slower). The draw inverts the CDF with one uniform per row, by blocks, instead of adding Gumbel
noise to every logit (a random number per vocabulary entry: ~70 ms at [64, 49152] on CPU).
"""

from __future__ import annotations

import functools
from typing import Generic, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt32

from jaxllm.runner.token_masks import ALL_ALLOWED, all_allowed
from jaxllm.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

TOPK_CANDIDATES = 128  # candidates tried before the exact bisection for top_k / top_p
CDF_BLOCK = 256  # vocabulary entries per block of the inverse-CDF draw (and of the argmax)
BISECT_UNROLL = 2  # bisection steps per loop iteration: full unrolling compiles slowly, none runs ~2x slower


# A step's input arrays: numpy as the host fills them, jax arrays inside the compiled step
ArrayT = TypeVar("ArrayT", Array, np.ndarray)


class SamplingInputs(NamedTuple, Generic[ArrayT]):
    temperature: Float[ArrayT, " S"]  # 0 → greedy (argmax after penalties and mask)
    top_k: Int[ArrayT, " S"]  # 0 → off
    top_p: Float[ArrayT, " S"]  # 1 → off
    min_p: Float[ArrayT, " S"]  # 0 → off
    repetition_penalty: Float[ArrayT, " S"]  # 1 → off; applies to tokens in prompt or output
    presence_penalty: Float[ArrayT, " S"]  # 0 → off; output tokens only
    frequency_penalty: Float[ArrayT, " S"]  # 0 → off; output tokens only
    seeds: Int[ArrayT, " S"]  # per-request seed (int32)
    steps: Int[ArrayT, " S"]  # number of tokens the request has generated so far
    history: Int[ArrayT, "S P"]  # prompt then output token ids, -1 padded (filled only for rows using penalties)
    prompt_lens: Int[ArrayT, " S"]  # how many leading history entries are prompt
    allowed: UInt32[ArrayT, "S W"]  # bit t%32 of word t//32 set → token t may be sampled (all ones: no mask)
    num_logprobs: Int[ArrayT, " S"]  # top logprobs wanted (-1: none)
    bias_ids: Int[ArrayT, "S B"]  # logit_bias token ids, -1 padded (B = MAX_LOGIT_BIAS)
    bias_values: Float[ArrayT, "S B"]  # and their biases
    target_ids: Int[ArrayT, " S"]  # a token to score on the row (prompt_logprobs), -1: none


class SamplerOutput(NamedTuple):
    token_ids: Int[Array, " S"]
    logprobs: Float[Array, " S"]  # raw log-softmax of the model's logits at the sampled token (0 when no row asked)
    ranks: Int[
        Array, " S"
    ]  # 1 + number of tokens with a strictly higher raw logprob (0 when no row asked for logprobs)
    top_token_ids: Int[Array, "S K"]  # K = MAX_LOGPROBS, by decreasing raw logprob
    top_logprobs: Float[Array, "S K"]
    target_logprobs: Float[Array, " S"]  # raw logprob of the row's target_ids token (0 where none)
    target_ranks: Int[Array, " S"]  # and its rank


# ---------------------------------------------------------------- host-side helpers (numpy)


def neutral_inputs(num_seqs: int, vocab_size: int, history_len: int = 1) -> SamplingInputs[np.ndarray]:
    """Numpy `SamplingInputs` whose every row is neutral: greedy, no penalties, no mask, no logprobs."""
    i32, f32 = np.int32, np.float32
    return SamplingInputs(
        temperature=np.zeros(num_seqs, f32),
        top_k=np.zeros(num_seqs, i32),
        top_p=np.ones(num_seqs, f32),
        min_p=np.zeros(num_seqs, f32),
        repetition_penalty=np.ones(num_seqs, f32),
        presence_penalty=np.zeros(num_seqs, f32),
        frequency_penalty=np.zeros(num_seqs, f32),
        seeds=np.zeros(num_seqs, i32),
        steps=np.zeros(num_seqs, i32),
        history=np.full((num_seqs, history_len), -1, i32),
        prompt_lens=np.zeros(num_seqs, i32),
        allowed=all_allowed(vocab_size, num_seqs),
        num_logprobs=np.full(num_seqs, -1, i32),
        bias_ids=np.full((num_seqs, MAX_LOGIT_BIAS), -1, i32),
        bias_values=np.zeros((num_seqs, MAX_LOGIT_BIAS), f32),
        target_ids=np.full(num_seqs, -1, i32),
    )


# ---------------------------------------------------------------- device side

_NEG_INF = -jnp.inf


def _row_max(x: Float[Array, "S V"]) -> Float[Array, "S 1"]:
    """Row max, 0 for rows that are -inf everywhere (so x - max stays -inf, never NaN)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _blocks(x: Float[Array, "S V"], block: int, fill: float) -> Float[Array, "S NB B"]:
    """x as [S, ceil(V / block), block], padded with `fill`."""
    S, V = x.shape
    B = min(block, V)
    nb = -(-V // B)
    if nb * B != V:
        x = jnp.pad(x, ((0, 0), (0, nb * B - V)), constant_values=fill)
    return x.reshape(S, nb, B)


def _first(mask: Array) -> Int[Array, " ..."]:
    """Index of the first True along the last axis (0 when none)."""
    return jnp.argmax(mask, axis=-1).astype(jnp.int32)


def _argmax(x: Float[Array, "S V"]) -> Int[Array, " S"]:
    """argmax, lowest index on ties, by blocks: one pass of block maxima, then one block.

    XLA CPU's variadic argmax reduction over [64, 49152] is 5-20x slower than this.
    """
    xb = _blocks(x, CDF_BLOCK, _NEG_INF)
    block_max = jnp.max(xb, axis=-1)
    m = jnp.max(block_max, axis=-1, keepdims=True)
    blk = _first(block_max == m)
    inner = jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0]
    return blk * xb.shape[2] + _first(inner == m)


def _apply_penalties(logits: Float[Array, "S V"], inp: SamplingInputs[Array]) -> Float[Array, "S V"]:
    S, V = logits.shape
    hist = inp.history.astype(jnp.int32)
    valid = (hist >= 0) & (hist < V)
    is_output = jnp.arange(hist.shape[1], dtype=jnp.int32)[None, :] >= inp.prompt_lens[:, None]
    rows = jnp.arange(S, dtype=jnp.int32)[:, None]
    # out-of-range indices (V) are dropped: no masking of the scattered values needed
    out_idx = jnp.where(valid & is_output, hist, V)
    prompt_idx = jnp.where(valid & ~is_output, hist, V)
    counts = jnp.zeros((S, V), jnp.int32).at[rows, out_idx].add(1, mode="drop")
    in_prompt = jnp.zeros((S, V), jnp.bool_).at[rows, prompt_idx].set(True, mode="drop")
    r = inp.repetition_penalty.astype(jnp.float32)[:, None]
    seen = in_prompt | (counts > 0)
    penalised = jnp.where(logits > 0, logits / r, logits * r)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - inp.frequency_penalty.astype(jnp.float32)[:, None] * counts.astype(jnp.float32)
    return logits - inp.presence_penalty.astype(jnp.float32)[:, None] * (counts > 0).astype(jnp.float32)


def _apply_mask(logits: Float[Array, "S V"], allowed: UInt32[Array, "S W"]) -> Float[Array, "S V"]:
    S, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (allowed.astype(jnp.uint32)[:, :, None] >> shifts) & jnp.uint32(1)
    bits = bits.reshape(S, -1)[:, :V]
    return jnp.where(bits != 0, logits, _NEG_INF)


def _apply_bias(logits: Float[Array, "S V"], inp: SamplingInputs[Array]) -> Float[Array, "S V"]:
    S, V = logits.shape
    ids = jnp.where(inp.bias_ids >= 0, inp.bias_ids, V)  # padding → out of range, dropped
    rows = jnp.arange(S, dtype=jnp.int32)[:, None]
    return logits.at[rows, ids].add(inp.bias_values.astype(jnp.float32), mode="drop")


def _stages_used(inp: SamplingInputs[Array]) -> tuple[Array, Array, Array]:
    """Whether any row uses a logit bias, a penalty, a mask (device-side booleans)."""
    any_penalty = (
        jnp.any(inp.repetition_penalty != 1) | jnp.any(inp.frequency_penalty != 0) | jnp.any(inp.presence_penalty != 0)
    )
    return jnp.any(inp.bias_ids >= 0), any_penalty, jnp.any(inp.allowed != ALL_ALLOWED)


def _penalised_masked(logits: Float[Array, "S V"], inp: SamplingInputs[Array]) -> Float[Array, "S V"]:
    """Stages a', b and c, each skipped when no row uses it."""
    any_bias, any_penalty, any_mask = _stages_used(inp)
    with jax.named_scope("logit_bias"):
        logits = jax.lax.cond(any_bias, lambda x: _apply_bias(x, inp), lambda x: x, logits)
    with jax.named_scope("penalties"):
        logits = jax.lax.cond(any_penalty, lambda x: _apply_penalties(x, inp), lambda x: x, logits)
    with jax.named_scope("mask"):
        return jax.lax.cond(any_mask, lambda x: _apply_mask(x, inp.allowed), lambda x: x, logits)


def _order_key(x: Float[Array, " ..."]) -> UInt32[Array, " ..."]:
    """uint32 keys in the same order as the floats (-inf smallest); equal floats give equal keys (0.0 == -0.0)."""
    x = jnp.where(x == 0, 0.0, x)
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    b = jnp.where(b < 0, b ^ jnp.int32(0x7FFFFFFF), b)
    return jax.lax.bitcast_convert_type(b, jnp.uint32) ^ jnp.uint32(0x80000000)


def _top_k(x: Float[Array, "S V"], k: int) -> tuple[Float[Array, "S k"], Int[Array, "S k"]]:
    """lax.top_k by blocks: the k best lie in the k blocks with the best maxima, so only those are searched.

    3-4x faster than lax.top_k over [64, 49152] on CPU for k = 20; the same values (order among
    exactly equal values may differ).
    """
    S, V = x.shape
    block = 128 if k <= 32 else 32
    xb = _blocks(x, block, _NEG_INF)
    nb, B = xb.shape[1], xb.shape[2]
    if nb <= 2 * k:
        return jax.lax.top_k(x, k)
    _, blocks = jax.lax.top_k(jnp.max(xb, axis=-1), k)  # [S, k]
    candidates = jnp.take_along_axis(xb, blocks[:, :, None], axis=1).reshape(S, k * B)
    vals, j = jax.lax.top_k(candidates, k)
    return vals, jnp.take_along_axis(blocks, j // B, axis=1) * B + j % B


def _largest_key(satisfied, S: int) -> UInt32[Array, " S"]:
    """The largest key t with satisfied(t) (a monotone, row-wise predicate true at 0), bit by bit."""

    def step(i, t):
        cand = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(satisfied(cand), cand, t)

    return jax.lax.fori_loop(0, 32, step, jnp.zeros(S, jnp.uint32), unroll=BISECT_UNROLL)


def _truncation_bisect(x, e, key_min, k_on, top_k, p_on, top_p) -> UInt32[Array, " S"]:
    """Exact threshold keys for top_k and top_p by bisection over the float order (no candidates needed)."""
    S = x.shape[0]
    key = _order_key(x)

    def kth(cand):
        return jnp.sum(key >= cand[:, None], axis=-1, dtype=jnp.int32) >= top_k

    key_k = jax.lax.cond(jnp.any(k_on), lambda: jnp.where(k_on, _largest_key(kth, S), key_min), lambda: key_min)
    key_k = jnp.maximum(key_k, key_min)
    e = jnp.where(key >= key_k[:, None], e, 0.0)
    target = top_p * jnp.sum(e, axis=-1)

    def reaches(cand):
        return jnp.sum(jnp.where(key >= cand[:, None], e, 0.0), axis=-1) >= target

    key_p = jax.lax.cond(jnp.any(p_on), lambda: jnp.where(p_on, _largest_key(reaches, S), key_k), lambda: key_k)
    return jnp.maximum(key_k, key_p)


def _truncation(
    x: Float[Array, "S V"], thr_min: Float[Array, " S"], top_k, top_p, candidates: int = TOPK_CANDIDATES
) -> UInt32[Array, " S"]:
    """Threshold keys of top_k then top_p on the scaled logits x, after a min_p threshold thr_min.

    The k-th largest of the min_p-filtered logits is max(thr_min, k-th largest of x), so top_k
    reads x directly; top_p renormalises over what min_p and top_k keep.
    """
    S, V = x.shape
    k_on = (top_k > 0) & (top_k < V)
    top_k = jnp.where(k_on, top_k, V).astype(jnp.int32)
    top_p = top_p.astype(jnp.float32)
    p_on = top_p < 1
    m = _row_max(x)
    e = jnp.exp(x - m)  # unnormalised probabilities
    C = min(candidates, V)
    vals = _top_k(x, C)[0]  # [S, C], descending
    # top_k from the candidates: exact when k <= C
    kth = jnp.take_along_axis(vals, jnp.clip(top_k - 1, 0, C - 1)[:, None], axis=1)[:, 0]
    thr_k = jnp.maximum(thr_min, jnp.where(k_on, kth, _NEG_INF))
    k_ok = ~k_on | (top_k <= C)
    # top_p from the candidates: exact when they hold enough of the mass min_p and top_k keep
    target = top_p * jnp.sum(jnp.where(x >= thr_k[:, None], e, 0.0), axis=-1)
    ec = jnp.where(vals >= thr_k[:, None], jnp.exp(vals - m), 0.0)
    cum = jnp.cumsum(ec, axis=-1)
    n_keep = jnp.sum((cum - ec) < target[:, None], axis=-1, dtype=jnp.int32)  # smallest prefix reaching target
    thr_p = jnp.take_along_axis(vals, jnp.clip(n_keep - 1, 0, C - 1)[:, None], axis=1)[:, 0]
    p_ok = ~p_on | (cum[:, -1] >= target)
    fast = _order_key(jnp.maximum(thr_k, jnp.where(p_on, thr_p, _NEG_INF)))
    return jax.lax.cond(
        jnp.all(k_ok & p_ok),
        lambda: fast,
        lambda: _truncation_bisect(x, e, _order_key(thr_min), k_on, top_k, p_on, top_p),
    )


def _scaled_threshold(
    z: Float[Array, "S V"], inp: SamplingInputs[Array]
) -> tuple[Float[Array, "S V"], UInt32[Array, " S"]]:
    """Stage e before the draw: (z / temperature, key threshold): a row keeps the tokens whose
    `_order_key` is >= its threshold (min_p, top_k, top_p). Greedy rows are scaled by 1."""
    t = inp.temperature.astype(jnp.float32)
    sampling = t > 0
    x = z / jnp.where(sampling, t, 1.0)[:, None]
    # filters of greedy rows are ignored (so they never trigger the truncation search)
    min_p = jnp.where(sampling, inp.min_p.astype(jnp.float32), 0.0)
    top_k = jnp.where(sampling, inp.top_k, 0)
    top_p = jnp.where(sampling, inp.top_p.astype(jnp.float32), 1.0)
    # min_p: p < min_p * max p  <=>  x < max x + log(min_p); log(0) = -inf keeps everything
    thr_min = _row_max(x)[:, 0] + jnp.log(min_p)
    any_trunc = jnp.any((top_k > 0) & (top_k < z.shape[1])) | jnp.any(top_p < 1)
    with jax.named_scope("top_k_top_p"):
        key = jax.lax.cond(any_trunc, lambda: _truncation(x, thr_min, top_k, top_p), lambda: _order_key(thr_min))
    return x, key


def _keep(x: Float[Array, "S V"], key: UInt32[Array, " S"]) -> Float[Array, "S V"]:
    return jnp.where(_order_key(x) >= key[:, None], x, _NEG_INF)


def processed_logits(logits: Float[Array, "S V"], inputs: SamplingInputs[Array]) -> Float[Array, "S V"]:
    """The logits a row samples from (-inf where excluded); greedy rows: the penalised, masked logits."""
    z = _penalised_masked(logits.astype(jnp.float32), inputs)
    x, key = _scaled_threshold(z, inputs)
    return jnp.where((inputs.temperature > 0)[:, None], _keep(x, key), z)


def _uniforms(seeds: Int[Array, " S"], steps: Int[Array, " S"]) -> Float[Array, " S"]:
    def one(seed, step):
        return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), step), dtype=jnp.float32)

    return jax.vmap(one)(seeds.astype(jnp.int32), steps.astype(jnp.int32))


def _last_positive(p: Float[Array, "S N"]) -> Int[Array, " S"]:
    iota = jax.lax.broadcasted_iota(jnp.int32, p.shape, 1)
    return jnp.max(jnp.where(p > 0, iota, 0), axis=-1)


def _draw(x: Float[Array, "S V"], key: UInt32[Array, " S"], u: Float[Array, " S"]) -> Int[Array, " S"]:
    """Inverse-CDF draw from softmax(x) over the tokens `key` keeps, one uniform per row, two levels
    deep (blocks, then tokens). Never returns an excluded token unless the row excludes everything.
    The row's max token is always kept, so x's max normalises the kept ones too.
    """
    e = jnp.where(_order_key(x) >= key[:, None], jnp.exp(x - _row_max(x)), 0.0)
    e = _blocks(e, CDF_BLOCK, 0.0)
    B = e.shape[2]
    block_mass = jnp.sum(e, axis=-1)  # [S, nb]
    cum = jnp.cumsum(block_mass, axis=-1)
    target = u * cum[:, -1]
    blk = jnp.sum(cum <= target[:, None], axis=-1, dtype=jnp.int32)
    blk = jnp.minimum(blk, _last_positive(block_mass))  # u * total may round up to total
    before = jnp.where(blk > 0, jnp.take_along_axis(cum, jnp.maximum(blk - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    inner = jnp.take_along_axis(e, blk[:, None, None], axis=1)[:, 0]  # [S, B]
    j = jnp.sum(jnp.cumsum(inner, axis=-1) <= (target - before)[:, None], axis=-1, dtype=jnp.int32)
    j = jnp.minimum(j, _last_positive(inner))
    return blk * B + j


def _raw_logprobs(logits: Float[Array, "S V"]) -> tuple[Float[Array, "S 1"], Float[Array, "S 1"]]:
    """(max, log of the sum of exp(logits - max)): raw = (logits - max) - log_sum, as jax.nn.log_softmax."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), jax.lax.stop_gradient(m), 0.0)
    return m, jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1, keepdims=True))


def _logprobs(logits, token_ids):
    """The sampled tokens' raw logprobs, their ranks, and the top MAX_LOGPROBS raw logprobs."""
    S, V = logits.shape
    m, log_sum = _raw_logprobs(logits)
    sampled_logprob = (jnp.take_along_axis(logits, token_ids[:, None], axis=1) - m - log_sum)[:, 0]
    raw = (logits - m) - log_sum
    ranks = 1 + jnp.sum(raw > sampled_logprob[:, None], axis=-1, dtype=jnp.int32)
    K = min(MAX_LOGPROBS, V)
    top_vals, top_ids = _top_k(logits, K)
    top_vals = (top_vals - m) - log_sum  # the same float ops as raw: equal to raw at top_ids
    if K < MAX_LOGPROBS:
        top_vals = jnp.pad(top_vals, ((0, 0), (0, MAX_LOGPROBS - K)), constant_values=_NEG_INF)
        top_ids = jnp.pad(top_ids, ((0, 0), (0, MAX_LOGPROBS - K)), constant_values=-1)
    return sampled_logprob, ranks, top_ids.astype(jnp.int32), top_vals


def sample(logits: Float[Array, "S V"], inputs: SamplingInputs[Array]) -> SamplerOutput:
    """One token per row, with its raw logprob, rank and the top MAX_LOGPROBS raw logprobs (see module doc)."""
    with jax.named_scope("sampler"):
        return _sample(logits, inputs)


def _sample(logits: Float[Array, "S V"], inputs: SamplingInputs[Array]) -> SamplerOutput:
    logits = logits.astype(jnp.float32)
    S, V = logits.shape
    sampling = inputs.temperature > 0

    def processed():
        z = _penalised_masked(logits, inputs)
        greedy = _argmax(z)

        def draw(z):
            x, key = _scaled_threshold(z, inputs)
            return jnp.where(sampling, _draw(x, key, _uniforms(inputs.seeds, inputs.steps)), greedy)

        return jax.lax.cond(jnp.any(sampling), draw, lambda z: greedy, z)

    # every row greedy and unprocessed: the argmax alone. Each skipped stage's cond still copies the logits
    # ([64, 49152] greedy on CPU: 4.9 -> 1.4 ms)
    plain = ~(jnp.any(sampling) | functools.reduce(jnp.logical_or, _stages_used(inputs)))
    token_ids = jax.lax.cond(plain, lambda: _argmax(logits), processed)

    def no_logprobs():
        return (
            jnp.zeros(S, jnp.float32),
            jnp.zeros(S, jnp.int32),
            jnp.zeros((S, MAX_LOGPROBS), jnp.int32),
            jnp.full((S, MAX_LOGPROBS), _NEG_INF, jnp.float32),
        )

    # the log-softmax only where a row asks for logprobs: its exp over the vocabulary was ~40 % of a greedy
    # step's sampler on CPU (70 us a row of 49152)
    sampled_logprob, ranks, top_ids, top_vals = jax.lax.cond(
        jnp.any(inputs.num_logprobs >= 0), lambda: _logprobs(logits, token_ids), no_logprobs
    )
    target_logprobs, target_ranks = jax.lax.cond(
        jnp.any(inputs.target_ids >= 0),
        lambda: _target_logprobs(logits, inputs.target_ids),
        lambda: (jnp.zeros(S, jnp.float32), jnp.zeros(S, jnp.int32)),
    )
    return SamplerOutput(
        token_ids.astype(jnp.int32), sampled_logprob, ranks, top_ids, top_vals, target_logprobs, target_ranks
    )


def _target_logprobs(logits, target_ids) -> tuple[Float[Array, " S"], Int[Array, " S"]]:
    """Raw logprob and rank of each row's target token (rows without one: 0, 0)."""
    has = target_ids >= 0
    m, log_sum = _raw_logprobs(logits)
    lp = (jnp.take_along_axis(logits, jnp.maximum(target_ids, 0)[:, None], axis=1) - m - log_sum)[:, 0]
    ranks = 1 + jnp.sum((logits - m) - log_sum > lp[:, None], axis=-1, dtype=jnp.int32)
    return jnp.where(has, lp, 0.0), jnp.where(has, ranks, 0)
