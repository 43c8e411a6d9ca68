"""Structured outputs through the OpenAI-compatible server with the official `openai` client:
response_format (json_schema, json_object with or without a schema) on chat and completions, vLLM's
structured_outputs and guided_* fields, forced tool calls (named and "required", streamed and not),
and 400s for bad constraints."""

import json

import jsonschema
import openai
import pytest

from tests.inprocess_server import MODEL

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
}
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a city",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["city"],
                "properties": {"city": {"type": "string", "maxLength": 20}},
            },
        },
    },
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


def chat(client, messages, max_tokens=80, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kwargs
    )


def test_chat_response_format_json_schema(client):
    response = chat(
        client,
        [{"role": "user", "content": "Give me a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completions_response_format_json_object(client):
    prompt = 'A JSON object with the keys "city" and "country" for the Eiffel Tower: '
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=64,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].text), dict)


def test_vllm_structured_outputs_field(client):
    response = chat(
        client,
        [{"role": "user", "content": "Which city is the capital of France?"}],
        extra_body={"structured_outputs": {"choice": ["Paris", "London", "Rome"]}},
    )
    assert response.choices[0].message.content in ("Paris", "London", "Rome")


def test_named_tool_choice_returns_a_valid_tool_call(client):
    response = chat(
        client, ASK_WEATHER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_tool_choice_streams_tool_calls(client):
    """As OpenAI streams a call: its id and name first, then its arguments in fragments."""
    stream = chat(client, ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True)
    pieces, finish_reason = [], None
    for chunk in stream:
        for choice in chunk.choices:
            pieces += choice.delta.tool_calls or []
            assert not choice.delta.content
            finish_reason = choice.finish_reason or finish_reason
    assert finish_reason == "tool_calls" and {p.index for p in pieces} == {0} and len(pieces) > 2
    head, *fragments = pieces
    assert head.id.startswith("call_") and head.function.name and head.function.arguments == ""
    assert all(p.id is None and p.function.name is None for p in fragments)
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[head.function.name]
    jsonschema.validate(json.loads("".join(p.function.arguments for p in fragments)), schema)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_object_with_a_schema_enforces_the_schema(client, endpoint):
    """`{"type": "json_object", "schema": {...}}` (instructor's JSON_SCHEMA mode) is held to its schema."""
    fmt = {"type": "json_object", "schema": PERSON}
    if endpoint == "chat":
        reply = chat(client, [{"role": "user", "content": "Give me a person as JSON."}], response_format=fmt)
        text = reply.choices[0].message.content
    else:
        completion = client.completions.create(
            model=MODEL, prompt="A person as JSON: ", temperature=0, max_tokens=64, extra_body={"response_format": fmt}
        )
        text = completion.choices[0].text
    jsonschema.validate(json.loads(text), PERSON)


def test_vllm_guided_fields_mean_structured_outputs(client):
    response = chat(
        client,
        [{"role": "user", "content": "Which city is the capital of France?"}],
        extra_body={"guided_choice": ["Paris", "London", "Rome"]},
    )
    assert response.choices[0].message.content in ("Paris", "London", "Rome")


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object", "schema": {"type": "nonsense"}}}, "response_format.schema"),
        ({"structured_outputs": {"regex": "a+"}, "guided_json": {"type": "object"}}, "guided_json"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
    ids=["unknown-type", "bad-schema", "bad-regex", "two-constraints", "bad-json-object-schema", "guided", "function"],
)
def test_bad_constraints_are_400s_and_the_server_serves_on(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, ASK_WEATHER, extra_body=extra)
    assert error.value.body["param"] == param
    assert not server.core.has_unfinished_requests() and server.core.structured.num_pending == 0
    assert chat(client, ASK_WEATHER, max_tokens=3).choices[0].finish_reason == "length"
