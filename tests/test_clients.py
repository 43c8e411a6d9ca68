"""The clients people point at an OpenAI-compatible server, against the in-process server (the
default model): langchain-openai (a `bind_tools` agent loop, `with_structured_output`, on chat
completions and on the Responses API), current instructor (JSON_SCHEMA and TOOLS), litellm (plain,
streamed, a tool call), and the official `openai` client's own helpers (`parse`, `stream`) and a
streamed call with no `tool_choice` (test_server_tools.py has the rest of the official client's
tool calls). The 135M model calls a tool when told to reply with the call's exact text
(test_server_tools.PARIS_CALL).

Two clients cannot share the test extra's environment, so they run by hand from their own venvs
(`@pytest.mark.manual`, skipped unless an environment variable names the venv's python; the
commands are in docs/serving.md, "Clients tried"): instructor 1.3 (pins openai<2; its JSON_SCHEMA
mode sends `{"type": "json_object", "schema": ...}`) and guidellm (pulls an unpinned torch).
"""

import json
import os
import subprocess
from pathlib import Path

import instructor
import openai
import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.inprocess_server import MODEL
from tests.test_server_tools import CALL_PLEASE, NO_CALL, TOOLS, chat, collect

# litellm's own response models warn when it serializes them, in its logging thread too
pytestmark = pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")

EXTRACT = "Paris is the capital of France. Extract the city and its country."


class City(BaseModel):
    name: str
    country: str


def assert_paris(city: City) -> None:
    assert city.name == "Paris" and city.country.lower() == "france", city


@tool
def get_weather(city: str) -> str:
    """Current weather in a city"""
    return f"22 C and sunny in {city}"


# ---- langchain-openai ---------------------------------------------------------------------------------


def langchain_model(server, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, **kwargs)


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_agent_loop_calls_the_tool_then_answers(server, responses_api):
    """`bind_tools` with a Python function (no tool_choice: the model decides), the first turn streamed
    as an agent streams it, the tool run on the parsed call, and the turn with its result a plain answer."""
    llm = langchain_model(server, max_tokens=40, use_responses_api=responses_api).bind_tools([get_weather])
    messages = [HumanMessage(CALL_PLEASE[0]["content"])]
    reply = None
    for chunk in llm.stream(messages):
        reply = chunk if reply is None else reply + chunk
    assert reply is not None
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"} and call["id"].startswith("call_")
    result = get_weather.invoke(call)  # a ToolMessage answering the call's id
    assert result.tool_call_id == call["id"]
    messages += [reply, result]
    answer = llm.invoke(messages)
    assert answer.tool_calls == [] and answer.text.strip()
    if not responses_api:
        assert answer.response_metadata["finish_reason"] == "stop"


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_with_structured_output_extracts_a_model(server, responses_api):
    llm = langchain_model(server, max_tokens=40, use_responses_api=responses_api)
    assert_paris(llm.with_structured_output(City, method="json_schema").invoke(EXTRACT))


# ---- instructor (current) -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "partial"])
@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS], ids=["json_schema", "tools"])
def test_instructor_extracts_a_model(client, mode, stream):
    patched = instructor.from_openai(client, mode=mode)
    sent: list[dict] = []
    patched.on("completion:kwargs", lambda *args, **kwargs: sent.append(kwargs))
    create = patched.chat.completions.create_partial if stream else patched.chat.completions.create
    result = create(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": EXTRACT}],
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )
    city = list(result)[-1] if stream else result  # create_partial yields the model as it fills in
    assert_paris(City.model_validate(city.model_dump()))
    (kwargs,) = sent
    if mode == instructor.Mode.JSON_SCHEMA:  # enforced by structured outputs, not asked for in the prompt
        assert kwargs["response_format"]["type"] == "json_schema" and "tools" not in kwargs
    else:
        assert kwargs["tool_choice"]["function"]["name"] == ("PartialCity" if stream else "City")


# ---- litellm ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm_completion(server):
    """litellm.completion aimed at the server, as litellm's docs say for an OpenAI-compatible one."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch its price list
    import litellm

    def completion(messages, **kwargs):
        return litellm.completion(
            model=f"openai/{MODEL}",
            api_base=server.url + "/v1",
            api_key="unused",
            messages=messages,
            temperature=0,
            **kwargs,
        )

    completion.stream_chunk_builder = litellm.stream_chunk_builder
    return completion


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_litellm_plain_and_streamed(litellm_completion):
    whole = litellm_completion(QUESTION, max_tokens=12)
    choice = whole.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0
    chunks = list(litellm_completion(QUESTION, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content  # greedy: the same text, in pieces
    assert len(chunks) > 3 and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_litellm_tool_call(litellm_completion, stream):
    response = litellm_completion(CALL_PLEASE, max_tokens=40, tools=TOOLS, stream=stream)
    if stream:
        response = litellm_completion.stream_chunk_builder(list(response))
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    plain = litellm_completion(NO_CALL, max_tokens=8, tools=TOOLS).choices[0]
    assert plain.message.content.strip() and not plain.message.tool_calls


# ---- the official openai client -------------------------------------------------------------------------


def test_openai_streamed_call_with_no_tool_choice(client):
    """`tools` alone mean tool_choice "auto" (OpenAI's default), streamed too."""
    content, calls, _, finish_reason = collect(chat(client, CALL_PLEASE, tools=TOOLS, stream=True))
    assert content == "" and finish_reason == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}


class Weather(BaseModel):
    city: str


def test_openai_sdk_parse_and_stream_helpers(client):
    """The SDK's typed helpers: `parse` turns a strict json_schema reply into the model and a call's
    arguments into a tool's model; `stream` parses the arguments as they arrive."""
    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": EXTRACT}], response_format=City, max_tokens=40, temperature=0
    )
    assert_paris(parsed.choices[0].message.parsed)
    weather = openai.pydantic_function_tool(Weather, name="get_weather")  # strict: additionalProperties false
    called = client.chat.completions.parse(
        model=MODEL, messages=CALL_PLEASE, tools=[weather], max_tokens=40, temperature=0
    )
    assert called.choices[0].message.tool_calls[0].function.parsed_arguments == Weather(city="Paris")
    with client.chat.completions.stream(
        model=MODEL, messages=CALL_PLEASE, tools=[weather], max_tokens=40, temperature=0
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events and "tool_calls.function.arguments.done" in events
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == Weather(city="Paris")


# ---- clients in their own venvs, run by hand (docs/serving.md, "Clients tried") ------------------------------


def venv_python(variable: str) -> str:
    python = os.environ.get(variable)
    if not python:
        pytest.skip(f"set {variable} to the python of the client's own venv (docs/serving.md, Clients tried)")
    return python


@pytest.mark.manual
def test_instructor_1_3_json_object_with_a_schema(server):
    """instructor 1.3 with openai<2 (tests/clients/instructor13.py): JSON_SCHEMA mode sends
    `{"type": "json_object", "schema": ...}`, which the server holds to the schema."""
    python = venv_python("JAXLLM_INSTRUCTOR13_PYTHON")
    script = Path(__file__).parent / "clients" / "instructor13.py"
    run = subprocess.run([python, str(script), server.url + "/v1", MODEL], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    json_schema, tools = (json.loads(line) for line in run.stdout.splitlines())
    assert json_schema["instructor"].startswith("1.3.") and json_schema["openai"].startswith("1.")
    assert json_schema["sent"]["response_format"]["type"] == "json_object"
    assert json_schema["sent"]["response_format"]["schema"]["required"] == ["name", "country"]
    assert tools["sent"]["tool_choice"] == {"type": "function", "function": {"name": "City"}}
    for result in (json_schema, tools):
        assert_paris(City(**result["city"]))


@pytest.mark.manual
@pytest.mark.parametrize(
    "request_format, profile, count",
    [("/v1/chat/completions", "kind=synchronous", 4), ("/v1/completions", "kind=concurrent,streams=4", 8)],
    ids=["chat-synchronous", "completions-concurrent"],
)
def test_guidellm_benchmark(server, tmp_path, request_format, profile, count):
    """guidellm benchmarks the server with synthetic prompts (its tokenizer from `jaxllm convert
    --tokenizer-only`): every request completes with the output length it asked for."""
    from jaxllm.entrypoints.convert import export_tokenizer

    python = venv_python("JAXLLM_GUIDELLM_PYTHON")
    tokenizer = export_tokenizer(None, str(tmp_path / "tokenizer"))
    report = tmp_path / "benchmarks.json"
    backend = f"kind=openai_http,target={server.url},model={MODEL},request_format={request_format}"
    command = [python, "-m", "guidellm", "run", "--backend", backend]
    command += ["--tokenizer", f"kind=huggingface_auto,model={tokenizer}"]
    command += ["--profile", profile, "--constraint", f"kind=max_requests,count={count}"]
    command += ["--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16"]
    command += ["--output", f"kind=json,path={report}", "--disable-progress"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    requests = benchmark["requests"]
    assert len(requests["successful"]) == count and not requests["errored"] and not requests["incomplete"]
    assert all(r["output"] and r["output_tokens"] == 16 for r in requests["successful"])
