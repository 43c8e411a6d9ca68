"""Tool calls through the OpenAI-compatible server with the official `openai` client.

tool_choice "auto" (and `tools` with no tool_choice) on the default model: the shipped ChatML tools
template and the `hermes` parser, non-streamed and streamed as OpenAI sends calls (id and name
first, then argument fragments), plain content when the model does not call, a two-turn loop with
a `tool` result; forced calls cut short by max_tokens come back as partial calls. The 135M model
calls a tool deterministically when told to reply with the call's exact text, or when structured
outputs force the opening tag.
"""

import json
import random
import re
from types import SimpleNamespace

import httpx
import openai
import pytest

from jaxllm.entrypoints.cli.serve import TOOL_PARSER_NAMES
from jaxllm.entrypoints.openai.api_server import serving_options
from jaxllm.entrypoints.openai.chat_templates import CHATML_TOOLS, load_chat_template
from jaxllm.entrypoints.openai.errors import OpenAIError
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_engine import ServingOptions
from jaxllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    NamedToolCallParser,
    RequiredToolCallsParser,
)
from jaxllm.structured.openai_fields import OutputConstraint
from tests.inprocess_server import MODEL

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 20}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time in a city", "parameters": WEATHER},
    },
]
PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_PLEASE = [{"role": "user", "content": f"Reply with exactly this text: {PARIS_CALL}"}]
NO_CALL = [{"role": "user", "content": "What is 2 + 2?"}]


def chat(client, messages, max_tokens=40, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kwargs
    )


def collect(stream):
    """A streamed reply: its content, its calls by index ({id, name, arguments}), the deltas of each
    call, and the finish reason."""
    content, calls, pieces, finish_reason = "", {}, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                pieces.setdefault(piece.index, []).append(piece)
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or piece.id
                if piece.function.name:
                    call["name"] = piece.function.name
                call["arguments"] += piece.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return content, calls, pieces, finish_reason


# ---- the parsers, without a server ------------------------------------------------------------------

HERMES_CASES = [
    "Hello world",
    "Trailing space stays  \n",
    PARIS_CALL,
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ri\\"s", "n": [1, {"a": 2}]}}\n'
    '</tool_call>\n<tool_call>{"name":"get_time","arguments":{}}</tool_call>\n',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut short
    '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',  # keys in another order
    '<tool_call>\n{"name": "get_time", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>',  # arguments as text
    "<tool_call>not json</tool_call> stays text",
    "a < b and <tool_ca is no tag",
]


def feed_in_pieces(parser, text, seed):
    rng, content, calls, i = random.Random(seed), "", {}, 0
    while True:
        step = rng.randint(1, 5)
        delta = parser.feed(text[i : i + step]) if i < len(text) else parser.finish()
        content += delta.content
        for piece in delta.calls:
            if piece.id is not None:
                calls[piece.index] = [piece.name, ""]
            calls[piece.index][1] += piece.arguments  # never before the call's id and name
        if i >= len(text):
            return content, [tuple(c) for c in calls.values()]
        i += step


@pytest.mark.parametrize("text", HERMES_CASES)
def test_hermes_parser_streams_exactly_what_it_returns_whole(text):
    whole = HermesToolParser()
    whole.parse(text)
    for seed in range(5):
        streamed = HermesToolParser()
        assert feed_in_pieces(streamed, text, seed) == (whole.content, [(c.name, c.arguments) for c in whole.calls])
    if "<tool_call>\n{" in text:
        assert whole.calls and whole.content.strip() in ("", "Let me check.")
        for call in whole.calls[:1]:
            assert call.name in ("get_weather", "get_time") and call.id.startswith("call_")
    else:
        assert whole.calls == [] and whole.content == text


def test_parsed_calls_and_finish_reasons():
    parser = HermesToolParser()
    parser.parse(HERMES_CASES[3])
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": 'Pa}ri"s', "n": [1, {"a": 2}]}),
        ("get_time", {}),
    ]
    assert parser.content == "Let me check." and parser.finish_reason("stop") == "tool_calls"
    one = HermesToolParser(max_calls=1)  # parallel_tool_calls: false
    one.parse(HERMES_CASES[3])
    assert [c.name for c in one.calls] == ["get_weather"]
    cut = HermesToolParser()
    cut.parse(HERMES_CASES[4])
    assert cut.calls[0].arguments == '{"city": "Pa' and cut.finish_reason("length") == "length"
    assert HermesToolParser().finish_reason("stop") == "stop"

    named = NamedToolCallParser("get_weather")
    assert feed_in_pieces(named, '{"city":"Pa', 0) == ("", [("get_weather", '{"city":"Pa')])
    array = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{"city":"Ro'
    required = RequiredToolCallsParser(["get_weather", "get_time"])
    assert feed_in_pieces(required, array, 0) == (
        "",
        [("get_weather", '{"city":"Paris"}'), ("get_time", '{"city":"Ro')],
    )
    inside_name = RequiredToolCallsParser(["get_weather", "get_time"])
    assert feed_in_pieces(inside_name, '[{"name":"get_ti', 0) == ("", [("get_time", "")])


def test_chat_template_flag_takes_a_name_a_file_or_a_template(tmp_path):
    assert load_chat_template(None) is None
    assert load_chat_template("chatml_tools") == CHATML_TOOLS
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="not a file"):
        load_chat_template("no-such-template")


def test_auto_tool_choice_needs_a_parser_except_on_the_default_model():
    default = SimpleNamespace(
        info=SimpleNamespace(model="SmolLM2-135M-Instruct", max_model_len=512, reasoning_parser=None), tokenizer=None
    )
    other = SimpleNamespace(
        info=SimpleNamespace(model="my/chatml-model", max_model_len=512, reasoning_parser=None), tokenizer=None
    )
    assert serving_options(default, None, False, None) == ServingOptions(None, CHATML_TOOLS, "hermes")
    assert serving_options(other, None, True, "hermes") == ServingOptions(None, None, "hermes")
    assert serving_options(other, "chatml_tools", False, None) == ServingOptions(CHATML_TOOLS, None, None)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        serving_options(other, None, True, None)
    with pytest.raises(ValueError, match="not one of"):
        serving_options(other, None, True, "mistral")
    assert set(TOOL_PARSER_NAMES) == set(TOOL_PARSERS)  # the CLI's choices, listed without importing the parsers
    chat = OpenAIServingChat(other, ["m"], options=serving_options(other, None, False, None))
    request = ChatCompletionRequest(messages=NO_CALL, tools=TOOLS)
    with pytest.raises(OpenAIError) as error:
        chat.tool_parser(request, OutputConstraint(None, None))
    assert error.value.param == "tool_choice" and "--enable-auto-tool-choice" in error.value.message


# ---- through the server -----------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_the_model_calls_a_tool_and_the_reply_has_tool_calls(client, tool_choice):
    extra = {"tool_choice": tool_choice} if tool_choice else {}
    choice = chat(client, CALL_PLEASE, tools=TOOLS, **extra).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_call_sends_its_id_and_name_then_argument_fragments(client):
    stream = chat(client, CALL_PLEASE, tools=TOOLS, tool_choice="auto", stream=True)
    content, calls, pieces, finish_reason = collect(stream)
    assert content == "" and finish_reason == "tool_calls" and list(calls) == [0]
    head, *fragments = pieces[0]
    assert head.id.startswith("call_") and head.type == "function" and head.function.name == "get_weather"
    assert head.function.arguments == "" and len(fragments) > 1
    assert all(p.id is None and p.function.name is None and p.function.arguments for p in fragments)
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_no_call_is_plain_content(client, stream):
    response = chat(client, NO_CALL, max_tokens=12, tools=TOOLS, stream=stream)
    if stream:
        content, calls, _, finish_reason = collect(response)
    else:
        choice = response.choices[0]
        content, calls, finish_reason = choice.message.content, choice.message.tool_calls or {}, choice.finish_reason
    assert content.strip() and "<tool_call>" not in content and not calls and finish_reason == "length"


def test_structured_outputs_can_force_the_opening_tag(client):
    pattern = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,9}"\}\}\n</tool_call>'
    stream = chat(
        client,
        [{"role": "user", "content": "What is the weather like in Paris?"}],
        tools=TOOLS,
        stream=True,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    content, calls, _, finish_reason = collect(stream)
    assert content == "" and finish_reason == "tool_calls"
    assert calls[0]["name"] == "get_weather"
    assert re.fullmatch(r"[A-Z][a-z]{1,9}", json.loads(calls[0]["arguments"])["city"])


def test_a_two_turn_loop_with_a_tool_result(server, client):
    first = chat(client, CALL_PLEASE, tools=TOOLS).choices[0].message
    (call,) = first.tool_calls
    messages = [
        *CALL_PLEASE,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"},
    ]
    second = chat(client, messages, max_tokens=8, tools=TOOLS).choices[0]
    assert second.finish_reason in ("stop", "length") and (second.message.content or second.message.tool_calls)
    # the conversation as the model saw it: the call replayed, the result in a tool turn
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tools>\n{"name": "get_weather"' in text
    assert f"<|im_start|>assistant\n{PARIS_CALL}<|im_end|>" in text
    assert "<|im_start|>tool\n<tool_response>\n22 C and sunny\n</tool_response><|im_end|>" in text


def test_langchain_bind_tools_agent_loop(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=40
    ).bind_tools(TOOLS)
    messages = [HumanMessage(CALL_PLEASE[0]["content"])]
    reply = llm.invoke(messages)
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    messages += [reply, ToolMessage("22 C and sunny", tool_call_id=call["id"])]
    assert llm.invoke(messages).response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "tool_choice, max_tokens",  # cut inside the arguments: `{"city":"Par` (named), `[{"name":..,"parameters":{"city`
    [({"type": "function", "function": {"name": "get_weather"}}, 4), ("required", 11)],
    ids=["named", "required"],
)
def test_a_forced_call_cut_by_max_tokens_is_a_partial_call(client, tool_choice, max_tokens, stream):
    response = chat(client, CALL_PLEASE, max_tokens=max_tokens, tools=TOOLS, tool_choice=tool_choice, stream=stream)
    if stream:
        content, by_index, _, finish_reason = collect(response)
        calls = list(by_index.values())
    else:
        choice = response.choices[0]
        content, finish_reason = choice.message.content, choice.finish_reason
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls
        ]
    assert not content and finish_reason == "length" and len(calls) == 1
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] in ("get_weather", "get_time")
    with pytest.raises(json.JSONDecodeError):  # cut short: the arguments so far, not valid JSON yet
        json.loads(calls[0]["arguments"])


def test_tool_choice_none_keeps_the_tools_out_of_the_prompt(server):
    body = {"messages": NO_CALL, "tools": TOOLS}
    with_tools = httpx.post(server.url + "/tokenize", json=body).json()["count"]
    plain = httpx.post(server.url + "/tokenize", json={"messages": NO_CALL}).json()["count"]
    assert with_tools > plain + 50
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": NO_CALL, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2},
    )
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == plain


def test_bad_tools_are_400s(client):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, NO_CALL, tools=[{"type": "function", "function": {"description": "no name"}}])
    assert error.value.body["param"] == "tools.0"
