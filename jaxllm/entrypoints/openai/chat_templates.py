"""Chat templates the server ships, and `--chat-template` (a file, a template string, or a shipped name).

`chatml_tools` is a ChatML template that knows tools, in the Hermes style many ChatML models
were trained on (Hermes 2 Pro, Qwen2.5): the tools are described as JSON in the system turn, the
model calls one as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and results come
back in a `tool` turn as `<tool_response>...</tool_response>`. The `hermes` tool-call parser reads
those calls back. The default model's own template is plain ChatML with no tool format, so the
server uses this one for its conversations that carry tools.
"""

from __future__ import annotations

from pathlib import Path

# Written for transformers' renderer (trim_blocks and lstrip_blocks on). The tool turn is ChatML's
# `tool` role; consecutive tool results share one turn. An assistant turn replays its calls in the
# same form the model is asked to write them.
CHATML_TOOLS = """\
{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}
    {%- set system_text = messages[0]['content'] -%}
    {%- set conversation = messages[1:] -%}
{%- else -%}
    {%- set system_text = '' -%}
    {%- set conversation = messages -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if system_text -%}
        {{- system_text + '\\n\\n' -}}
    {%- endif -%}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\\n' + ((tool['function'] if tool['function'] is defined else tool) | tojson) -}}
    {%- endfor -%}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif system_text -%}
    {{- '<|im_start|>system\\n' + system_text + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in conversation -%}
    {%- if message['role'] == 'tool' -%}
        {%- if loop.first or conversation[loop.index0 - 1]['role'] != 'tool' -%}
            {{- '<|im_start|>tool' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}
        {%- if loop.last or conversation[loop.index0 + 1]['role'] != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- elif message['role'] == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}
        {%- for call in message['tool_calls'] or [] -%}
            {%- set function = call['function'] if call['function'] is defined else call -%}
            {%- if message['content'] or not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {{- '<tool_call>\\n{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": ' -}}
            {%- if function['arguments'] is string -%}
                {{- function['arguments'] -}}
            {%- else -%}
                {{- function['arguments'] | tojson -}}
            {%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- else -%}
        {%- set role = 'system' if message['role'] == 'developer' else message['role'] -%}
        {{- '<|im_start|>' + role + '\\n' + message['content'] + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

SHIPPED = {"chatml_tools": CHATML_TOOLS}


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a shipped template's name, a file's path, or the template itself (as vLLM's flag)."""
    if value is None:
        return None
    if value in SHIPPED:
        return SHIPPED[value]
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template string too long to be a file name
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"--chat-template {value!r}: not a file, a Jinja template or a shipped template ({', '.join(SHIPPED)})"
    )
