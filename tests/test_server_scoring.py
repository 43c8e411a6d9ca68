"""Scoring through /v1/completions, as lm-evaluation-harness does: echo + logprobs (max_tokens 0 and 1),
vLLM's prompt_logprobs extra, and logit_bias."""

import httpx
import pytest

from jaxllm import SamplingParams
from tests.inprocess_server import MODEL

PROMPT = "The capital of France is Paris"


def complete(server, **body):
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_logprobs_cover_the_prompt_then_the_completion(server, llm, max_tokens, as_ids):
    tok = server.core.tokenizer
    ids = tok.encode(PROMPT)
    r = complete(server, prompt=ids if as_ids else PROMPT, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"].startswith(PROMPT) and choice["finish_reason"] == "length"
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(lp["tokens"][: len(ids)]) == PROMPT
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    (offline,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    offline = offline.prompt_logprobs
    for position in range(1, len(ids)):
        assert lp["token_logprobs"][position] == pytest.approx(offline[position][ids[position]].logprob, abs=1e-5)
        assert len(lp["top_logprobs"][position]) >= 2
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_prompt_logprobs_extra_field_and_its_limits(server):
    r = complete(server, prompt=PROMPT, max_tokens=1, prompt_logprobs=1, temperature=0)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    ids = server.core.tokenizer.encode(PROMPT)
    assert entries[0] is None and len(entries) == len(ids)
    assert str(ids[1]) in entries[1]
    r = complete(server, prompt=PROMPT, max_tokens=1, prompt_logprobs=1, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = complete(server, prompt=PROMPT, max_tokens=0)  # 0 only with echo
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_logit_bias_changes_the_greedy_token(server):
    plain = complete(server, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0).json()["choices"][0]
    first = server.core.tokenizer.encode(plain["text"], add_special_tokens=False)[0]
    target = server.core.tokenizer.encode(" London", add_special_tokens=False)[0]
    biased = complete(
        server, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(first): -100, str(target): 100}
    ).json()["choices"][0]
    assert biased["text"] == " London"
    r = complete(server, prompt=PROMPT, max_tokens=1, logit_bias={"99999999": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
