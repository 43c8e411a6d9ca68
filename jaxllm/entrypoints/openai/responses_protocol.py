"""The Responses API's request body, and its input, tools and text format read as a chat request.

`/v1/responses` runs through the chat endpoint's machinery (template, constraints, tool-call
parsers): `chat_request` turns a Responses request into a `ChatCompletionRequest`, refusing with a
400 naming it every field or item this server cannot honour.
"""

from __future__ import annotations

from typing import Any

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, RequestModel
from jaxllm.entrypoints.openai.unsupported import unsupported

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing is obfuscated
    user: str | None = None
    metadata: dict[str, Any] | None = None
    # accepted: they change nothing here
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None  # only false is honoured (nothing is stored): true is refused
    truncation: str | None = None  # "disabled" only
    # vLLM's extras
    request_id: str | None = None
    priority: int = 0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # refused when set (`refuse_unsupported_responses`)
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    background: Any = None
    include: Any = None
    reasoning: Any = None
    top_logprobs: Any = None


REFUSED = {
    "previous_response_id": "is not supported yet: responses are not stored; send the whole conversation as input",
    "conversation": "is not supported yet: conversations are not stored; send the whole conversation as input",
    "prompt": "is not supported: no stored prompt templates",
    "background": "is not supported yet",
    "include": "is not supported yet",
    "reasoning": "is not supported: the model does not reason",
    "top_logprobs": "is not supported yet",
}


def chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that does what `request` asks; a 400 naming anything it cannot."""
    for name, why in REFUSED.items():
        value = getattr(request, name)
        if isinstance(value, dict) and not any(v is not None for v in value.values()):
            continue  # {"effort": null}: asks for nothing
        if value not in (None, False, [], {}, 0):
            raise unsupported(name, why)
    if request.store:
        raise unsupported("store", "is not supported yet: responses are not stored (send store: false)")
    if request.truncation not in (None, "disabled"):
        raise unsupported("truncation", "must be 'disabled': a conversation too long for the model is refused")
    if request.service_tier not in (None, "auto", "default"):
        raise unsupported("service_tier", "must be 'auto' or 'default'")
    if request.max_tool_calls is not None and request.max_tool_calls < 1:
        raise bad_request("max_tool_calls must be at least 1", "max_tool_calls")
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + input_messages(
        request.input
    )
    return ChatCompletionRequest(
        model=request.model,
        messages=[ChatMessage.model_validate(m) for m in messages],
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=chat_tools(request.tools),
        tool_choice=chat_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=response_format(request.text),
        stream=request.stream,
        user=request.user,
        priority=request.priority,
        request_id=request.request_id,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        seed=request.seed,
        chat_template_kwargs=request.chat_template_kwargs,
    )


def input_messages(value: str | list[dict[str, Any]]) -> list[dict]:
    """Input items → chat messages: messages as they are, a reasoning item as the `reasoning_content` of the
    assistant turn it opens, function calls as an assistant turn's `tool_calls` (consecutive calls share one
    turn), their outputs as `tool` messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise bad_request("input must be a non-empty string or list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"input.{i}.role must be user, system, developer or assistant", f"input.{i}.role")
            content = _text(item.get("content"), f"input.{i}.content")
            last = messages[-1] if messages else None
            if role == "assistant" and last is not None and last.get("reasoning_content") is not None:
                if not last["content"] and "tool_calls" not in last:  # the turn its reasoning item opened
                    last["content"] = content
                    continue
            messages.append({"role": role, "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thinking = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
            messages.append({"role": "assistant", "content": "", "reasoning_content": thinking})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", i),
                "type": "function",
                "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # its text, or calls before this one: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"input.{i}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": content})
        else:
            raise unsupported(
                f"input.{i}.type",
                f"{kind!r} is not supported: input items are message, reasoning, function_call, function_call_output",
            )
    return messages


def _string(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input.{i}.{key} must be a string", f"input.{i}.{key}")
    return value


def _text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise unsupported(f"{param}.{j}", f"({kind!r}) is not supported: content parts are text")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Function tools (`{"type": "function", "name", "description", "parameters"}`) in chat's form."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise unsupported(f"tools.{i}", f"({kind!r}) is not supported: tools are functions")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")


def response_format(text: dict[str, Any] | None) -> dict | None:
    """`text.format` → chat's `response_format`."""
    if text is None:
        return None
    if text.get("verbosity") is not None:
        raise unsupported("text.verbosity", "is not supported yet")
    fmt = text.get("format")
    if fmt is None or not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt
