"""POST /v1/responses through the official `openai` client, streamed and not: text with `instructions`,
`input` as a string or items, `max_output_tokens`, `temperature`, function tools (a call and its
output in a second turn), `text.format` json_schema, and 400s naming what is not supported."""

import json

import httpx
import jsonschema
import openai
import pytest

from tests.inprocess_server import MODEL

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
}
PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_PLEASE = f"Reply with exactly this text: {PARIS_CALL}"
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."


def create(client, **kwargs):
    return client.responses.create(model=MODEL, temperature=0, **kwargs)


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_a_text_response_is_what_chat_answers(client):
    response = create(client, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=12)
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and response.output_text == chat.choices[0].message.content
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 12
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    finished = chat.choices[0].finish_reason == "stop"
    assert response.status == ("completed" if finished else "incomplete") and item.status == response.status


def test_a_streamed_response_sends_openais_events(client):
    whole = create(client, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=12)
    events = events_of(create(client, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert "".join(deltas) == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id


def test_max_output_tokens_makes_an_incomplete_response(client):
    response = create(client, input=QUESTION, max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output[0].status == "incomplete"


def test_input_items_give_the_same_prompt_as_the_string(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    by_items = create(client, input=items, max_output_tokens=4)
    by_string = create(client, input=QUESTION, max_output_tokens=4)
    assert by_items.usage.input_tokens == by_string.usage.input_tokens and by_items.output_text == by_string.output_text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_function_call_and_its_output_in_a_second_turn(client, stream):
    if stream:
        events = events_of(create(client, input=CALL_PLEASE, tools=[WEATHER_TOOL], max_output_tokens=40, stream=True))
        kinds = [e.type for e in events]
        assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
        assert events[2].item.arguments == "" and kinds.count("response.function_call_arguments.delta") > 1
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert done.arguments == "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        response = events[-1].response
    else:
        response = create(client, input=CALL_PLEASE, tools=[WEATHER_TOOL], max_output_tokens=40, max_tool_calls=1)
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"

    second = create(
        client,
        input=[
            {"role": "user", "content": CALL_PLEASE},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"},
        ],
        tools=[WEATHER_TOOL],
        max_output_tokens=8,
    )
    assert second.status in ("completed", "incomplete") and second.output


def test_text_format_json_schema(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    response = create(client, input="Give me a person as JSON.", text={"format": fmt}, max_output_tokens=64)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), PERSON)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bad"}}}}, "text.format.schema"),
    ],
)
def test_what_is_not_supported_is_a_400_naming_it(server, extra, param):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 2, **extra}
    response = httpx.post(server.url + "/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 1})


def test_the_client_raises_for_an_unknown_model(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="Hi")
