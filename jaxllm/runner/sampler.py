"""On-device sampling for one engine step (interface; the implementation is being written).

Rows are sequences; padding rows carry neutral values (temperature 0, no penalties).
"""

from __future__ import annotations

from typing import NamedTuple

from jaxtyping import Array, Float, Int, UInt32

from jaxllm.sampling_params import MAX_LOGPROBS  # noqa: F401  (K below)


class SamplingInputs(NamedTuple):
    temperature: Float[Array, "S"]  # 0 → greedy (argmax after penalties and mask)
    top_k: Int[Array, "S"]  # 0 → off
    top_p: Float[Array, "S"]  # 1 → off
    min_p: Float[Array, "S"]  # 0 → off
    repetition_penalty: Float[Array, "S"]  # 1 → off; applies to tokens in prompt or output
    presence_penalty: Float[Array, "S"]  # 0 → off; output tokens only
    frequency_penalty: Float[Array, "S"]  # 0 → off; output tokens only
    seeds: Int[Array, "S"]  # per-request seed (int32)
    steps: Int[Array, "S"]  # number of tokens the request has generated so far
    history: Int[Array, "S P"]  # prompt then output token ids, -1 padded (filled only for rows using penalties)
    prompt_lens: Int[Array, "S"]  # how many leading history entries are prompt
    allowed: UInt32[Array, "S W"]  # bit t%32 of word t//32 set → token t may be sampled (all ones: no mask)
    num_logprobs: Int[Array, "S"]  # top logprobs wanted (-1: none)


class SamplerOutput(NamedTuple):
    token_ids: Int[Array, "S"]
    logprobs: Float[Array, "S"]  # raw log-softmax of the model's logits at the sampled token
    ranks: Int[Array, "S"]  # 1 + number of tokens with a strictly higher raw logprob
    top_token_ids: Int[Array, "S K"]  # K = MAX_LOGPROBS, by decreasing raw logprob
    top_logprobs: Float[Array, "S K"]
