"""Reasoning models' thinking (`<think>…</think>`) kept apart from their answer: which syntax a model writes
(syntax), the text split into reasoning and answer as it streams (splitter), and the token-level gate that holds a
request's grammar back until the reasoning ends (gate)."""

from jaxllm.reasoning.gate import ReasoningGate
from jaxllm.reasoning.splitter import ReasoningSplitter, SplitDelta
from jaxllm.reasoning.syntax import REASONING_PARSERS, Phase, ReasoningSyntax, resolve_reasoning_parser

__all__ = [
    "REASONING_PARSERS",
    "Phase",
    "ReasoningGate",
    "ReasoningSplitter",
    "ReasoningSyntax",
    "SplitDelta",
    "resolve_reasoning_parser",
]
