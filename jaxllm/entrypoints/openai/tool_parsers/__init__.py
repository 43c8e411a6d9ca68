"""Tool-call parsers: a choice's generated text → content and OpenAI `tool_calls`, whole or as stream deltas.

- `base.py`       the parser interface, calls and their streamed pieces
- `json_stream.py` where a call's JSON ends, read a piece at a time
- `hermes.py`     `<tool_call>{...}</tool_call>` (`--tool-call-parser hermes`, as vLLM's)
- `forced.py`     forced calls (a named function, or "required"), including ones cut short
"""

from jaxllm.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolCall, ToolCallDelta, ToolParser
from jaxllm.entrypoints.openai.tool_parsers.forced import NamedToolCallParser, RequiredToolCallsParser
from jaxllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser

# --tool-call-parser NAME → the parser for tool_choice "auto"
TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "NamedToolCallParser",
    "ParsedDelta",
    "RequiredToolCallsParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
]
