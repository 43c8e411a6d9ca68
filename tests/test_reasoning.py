"""Reasoning models: the thinking split from the answer as text (any chunking gives the same split), the grammar
starting after `</think>`, and the server's reasoning_content / reasoning items / reasoning_tokens, on a tiny Qwen3
whose greedy output is a fixed chain (tests/tiny_models.py: it thinks "Let me think. 2+2 is 4.", then answers)."""

import json
import random

import httpx
import jsonschema
import openai
import pytest

from jaxllm import SamplingParams
from jaxllm.reasoning import REASONING_PARSERS, Phase, ReasoningGate, ReasoningSplitter, resolve_reasoning_parser
from jaxllm.sampling_params import StructuredOutputsParams
from tests.inprocess_server import MODEL, InProcessServer
from tests.tiny_models import (
    QWEN3_THINKING_TEMPLATE,
    R1_TEMPLATE,
    REASONING_ANSWER,
    REASONING_TEXT,
    save_reasoning_test_model,
)

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "What is 2+2?"}]
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, progress=False)


# ---- the text splitter ------------------------------------------------------------------------


def split(syntax, phase, text, cuts=()):
    """`text` fed in pieces cut at `cuts`, then finished: (reasoning, content)."""
    splitter = ReasoningSplitter(syntax, phase)
    reasoning = content = ""
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        out = splitter.feed(text[a:b])
        reasoning, content = reasoning + out.reasoning, content + out.content
    out = splitter.finish()
    return reasoning + out.reasoning, content + out.content


CASES = [
    # (syntax, phase at the start, output, reasoning, content)
    (QWEN3, Phase.MAY_OPEN, "<think>\nhmm, <b>\n</think>\n\nThe answer.", "hmm, <b>", "The answer."),
    (QWEN3, Phase.MAY_OPEN, "No thinking: </think> is text here", "", "No thinking: </think> is text here"),
    (QWEN3, Phase.ANSWER, '{"a": 1}', "", '{"a": 1}'),  # enable_thinking false: never reasoning (vLLM #19839)
    (R1, Phase.REASONING, "mid-thought </thi and on</think>answer", "mid-thought </thi and on", "answer"),
    (R1, Phase.REASONING, "<think>repeated tag</think> x", "repeated tag", "x"),
    (R1, Phase.REASONING, "cut short by max_tokens </thi", "cut short by max_tokens </thi", ""),
    (R1, Phase.MAY_OPEN, "  \n", "", ""),
]


@pytest.mark.parametrize("syntax,phase,text,reasoning,content", CASES)
def test_every_chunking_splits_alike(syntax, phase, text, reasoning, content):
    """Whole, every cut in two, and random cuts into many pieces (chunks of several tokens straddling a tag, as
    speculative decoding sends them: vLLM #55195, #43221) give one split."""
    assert split(syntax, phase, text) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert split(syntax, phase, text, [cut]) == (reasoning, content), cut
    rng = random.Random(0)
    for _ in range(200):
        cuts = rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 8)))
        assert split(syntax, phase, text, cuts) == (reasoning, content), cuts


def test_reasoning_tokens_count_up_to_the_end_tag():
    splitter = ReasoningSplitter(QWEN3, Phase.MAY_OPEN, end_token_id=6)
    splitter.feed("<think>a", [3, 10])
    splitter.feed("b</think>c", [11, 6, 12])  # a chunk past the end tag: only the tag counts
    splitter.feed("d", [13])
    assert splitter.reasoning_tokens == 4
    plain = ReasoningSplitter(QWEN3, Phase.MAY_OPEN, end_token_id=6)
    plain.feed("no thinking", [10, 11])
    assert plain.reasoning_tokens == 0


def test_first_phase_reads_the_prompts_last_tag():
    assert QWEN3.first_phase("user: what is <think>?<|im_start|>assistant\n") is Phase.REASONING
    assert QWEN3.first_phase("assistant\n<think>\n\n</think>\n\n") is Phase.ANSWER
    assert QWEN3.first_phase("assistant\n") is Phase.MAY_OPEN
    assert R1.first_phase("assistant\n") is Phase.REASONING
    assert R1.first_phase([1, 2, 3, 9], start=3, end=6) is Phase.REASONING
    assert R1.first_phase([3, 8, 6, 8], start=3, end=6) is Phase.ANSWER


def test_gate_frees_the_reasoning_and_hands_the_answer_to_the_grammar():
    gate = ReasoningGate(QWEN3, 3, 6, prompt_token_ids=[1, 9])
    assert gate.phase is Phase.MAY_OPEN and gate.constrained  # the grammar's first token, or <think>
    assert not gate.feeds_grammar(3) and not gate.constrained
    # positions sampled after drafts: all reasoning; the answer's from the one after a drafted end tag
    assert gate.answer_start([10, 11]) is None and gate.answer_start([10, 6, 12]) == 2 and gate.answer_start([6]) == 1
    assert not gate.feeds_grammar(10) and not gate.feeds_grammar(6)
    assert gate.feeds_grammar(12) and gate.constrained and gate.answer_start([12]) == 0
    off = ReasoningGate(QWEN3, 3, 6, prompt_token_ids=[1, 3, 8, 6, 8])
    assert off.phase is Phase.ANSWER and off.feeds_grammar(3)  # thinking off: the grammar from the first token


def test_grammar_masks_start_after_a_drafted_end_tag(model_path):
    """Speculative drafts may carry the thinking into the answer in one step: positions up to the end tag are free,
    the one after it gets the grammar's first mask; a draft past the tag that the grammar rejects is cut."""
    from transformers import AutoTokenizer

    from jaxllm.request import Request
    from jaxllm.runner.token_masks import all_allowed, allowed_token_ids
    from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput
    from jaxllm.structured.manager import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(model_path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<think>", "Let me think.", "</think>", '{"answer":', "4"]}
    manager = StructuredOutputManager(tok, 128, (tok.eos_token_id,), reasoning=QWEN3)
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    request = Request("r", list(prompt), params, (tok.eos_token_id,))
    manager.add("r", [request])
    manager.wait(timeout=30)
    assert manager.take_compiled() == [([request], None)]
    first = all_allowed(128, 1)
    manager.fill_bitmask(SchedulerOutput(0, [ScheduledRequest(request, 1, len(prompt) - 1, [])]).scheduled, first)
    assert ids["<think>"] in allowed_token_ids(first[0], 128)  # the grammar's first tokens, or <think>
    assert not manager.advance(request, ids["<think>"])
    drafts = [ids["Let me think."], ids["</think>"], ids["4"]]  # "4" cannot open a JSON object
    assert manager.valid_prefix(request, drafts) == 2
    request.output_token_ids.append(ids["<think>"])
    step = ScheduledRequest(request, 3, len(prompt), [], draft_token_ids=drafts[:2])
    allowed = all_allowed(128, 3)
    assert manager.fill_bitmask(SchedulerOutput(0, [step]).scheduled, allowed) == [2]
    assert (allowed[:2] == all_allowed(128)).all()  # reasoning: free
    assert ids['{"answer":'] in allowed_token_ids(allowed[2], 128) and ids["4"] not in allowed_token_ids(
        allowed[2], 128
    )


def test_auto_reasoning_parser_reads_the_chat_template(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("reasoning")
    save_reasoning_test_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert resolve_reasoning_parser("auto", tokenizer) is QWEN3  # enable_thinking in it
    tokenizer.chat_template = R1_TEMPLATE.replace("enable_thinking", "thinking_off")
    assert resolve_reasoning_parser("auto", tokenizer) is R1  # <think> opened by the template
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    assert resolve_reasoning_parser("auto", tokenizer) is None
    assert resolve_reasoning_parser("none", tokenizer) is None
    with pytest.raises(ValueError, match="must be one of"):
        resolve_reasoning_parser("qwen", tokenizer)


def test_a_named_parser_needs_its_tags_in_the_vocabulary(default_model):
    with pytest.raises(ValueError, match="not one token of this model's vocabulary"):
        resolve_reasoning_parser("qwen3", default_model.tokenizer)
    assert resolve_reasoning_parser("auto", default_model.tokenizer) is None  # SmolLM2 does not think


# ---- the engine and the server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-thinking")
    save_reasoning_test_model(path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    s = InProcessServer(model=model_path, **{k: v for k, v in ENGINE.items() if k != "progress"})
    yield s
    s.stop()


def chat(server, **body):
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 16, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(server, **body):
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 16, "stream": True, **body}
    body["stream_options"] = {"include_usage": True}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "".join(d.get("reasoning") or "" for d in deltas)  # both names carry the same text
    content = "".join(d.get("content") or "" for d in deltas)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return reasoning, content, finish, chunks[-1]["usage"]


def test_reply_splits_thinking_from_answer_streamed_or_not(server):
    body = chat(server)
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["reasoning"], message["content"]) == (
        REASONING_TEXT,
        REASONING_TEXT,
        REASONING_ANSWER,
    )
    # <think>, two words of thinking, </think>
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    reasoning, content, finish, usage = stream_chat(server)
    assert (reasoning, content, finish) == (REASONING_TEXT, REASONING_ANSWER, ["stop"])
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 4}


def test_the_schema_applies_after_the_reasoning(server):
    """With a grammar from the first token the model could not think (its `<think>` is not JSON); it thinks, then
    answers in the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for reply in (chat(server, response_format=fmt), None):
        if reply is None:
            reasoning, content, _, _ = stream_chat(server, response_format=fmt)
        else:
            message = reply["choices"][0]["message"]
            reasoning, content = message["reasoning_content"], message["content"]
        assert reasoning == REASONING_TEXT
        jsonschema.validate(json.loads(content), SCHEMA)


def test_thinking_off_puts_the_answer_in_content(server):
    """`enable_thinking: false` renders an empty <think></think>: the answer is content, never reasoning."""
    message = chat(server, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, REASONING_ANSWER)
    reasoning, content, _, usage = stream_chat(server, chat_template_kwargs={"enable_thinking": False})
    assert (reasoning, content, usage["completion_tokens_details"]) == ("", REASONING_ANSWER, {"reasoning_tokens": 0})


def test_max_tokens_inside_the_reasoning_returns_it_and_an_empty_answer(server):
    choice = chat(server, max_tokens=2)["choices"][0]
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == ("Let me think.", "")
    assert choice["finish_reason"] == "length"


def test_include_reasoning_false_drops_the_thinking(server):
    message = chat(server, include_reasoning=False)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, REASONING_ANSWER)


def test_openai_sdk_reads_reasoning_content(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
    assert reply.choices[0].message.reasoning_content == REASONING_TEXT
    assert reply.choices[0].message.content == REASONING_ANSWER
    # a conversation that sends the thinking back, under either name, renders and runs
    for key in ("reasoning_content", "reasoning"):
        turn = {"role": "assistant", "content": REASONING_ANSWER, key: REASONING_TEXT}
        messages = [*QUESTION, turn, {"role": "user", "content": "And 3+3?"}]
        again = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
        assert again.choices[0].message.content == REASONING_ANSWER


def test_responses_api_has_a_reasoning_item(server):
    body = {"model": MODEL, "input": "What is 2+2?", "temperature": 0, "max_output_tokens": 16}
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    reasoning, message = reply["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": REASONING_TEXT}
    ]
    assert message["content"][0]["text"] == REASONING_ANSWER
    assert reply["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    done = [e["text"] for e in events if e["type"] == "response.reasoning_text.done"]
    assert deltas == REASONING_TEXT and done == [REASONING_TEXT]
    final = events[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["reasoning", "message"]
    # the reasoning item sent back as input opens the assistant turn it belongs to
    items = [{"role": "user", "content": "What is 2+2?"}, reasoning, message, {"role": "user", "content": "And 3+3?"}]
    again = httpx.post(server.url + "/v1/responses", json={**body, "input": items}, timeout=60)
    assert again.status_code == 200, again.text


def test_offline_grammar_waits_for_a_template_opened_reasoning(model_path):
    """DeepSeek-R1's templates open <think> in the prompt: the output starts mid-thought with no tag, and the
    grammar starts after its </think>."""
    from jaxllm import LLM

    llm = LLM(model=model_path, reasoning_parser="deepseek_r1", kv_cache_memory_bytes=1 << 22, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    (out,) = llm.chat(QUESTION, params, use_tqdm=False, chat_template=R1_TEMPLATE)
    assert out.outputs[0].text == f"Let me think. 2+2 is 4.</think>{REASONING_ANSWER}"
    (off,) = llm.chat(
        QUESTION,
        params,
        use_tqdm=False,
        chat_template=QWEN3_THINKING_TEMPLATE,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert off.outputs[0].text == REASONING_ANSWER
