"""The grammar of a reasoning request starts when its reasoning ends (as vLLM's): while the model thinks, its
tokens are free and its matcher is not fed; the token after `</think>` is the grammar's first. At an output's
very start a `qwen3` model may still open `<think>`: that one token is allowed beside the grammar's."""

from __future__ import annotations

from collections.abc import Sequence

from jaxllm.reasoning.syntax import Phase, ReasoningSyntax


class ReasoningGate:
    def __init__(self, syntax: ReasoningSyntax, start_id: int, end_id: int, prompt_token_ids: Sequence[int]):
        self.start_id, self.end_id = start_id, end_id
        self.phase = syntax.first_phase(prompt_token_ids, start_id, end_id)

    @property
    def constrained(self) -> bool:
        """Whether the next token is the grammar's (at MAY_OPEN: the grammar's, or the start tag)."""
        return self.phase is not Phase.REASONING

    def feeds_grammar(self, token: int) -> bool:
        """Take one output token: True when it is the answer's, for the grammar's matcher."""
        if self.phase is Phase.ANSWER:
            return True
        if self.phase is Phase.REASONING:
            if token == self.end_id:
                self.phase = Phase.ANSWER
            return False
        if token == self.start_id:
            self.phase = Phase.REASONING
            return False
        self.phase = Phase.ANSWER
        return True

    def answer_start(self, drafts: Sequence[int]) -> int | None:
        """Where the answer starts among a step's sampled positions (position j samples after `drafts[:j]`): 0 when
        it has started, the position after the end tag when the drafts carry the reasoning into the answer, None
        when every position is reasoning (free of the grammar)."""
        if self.phase is not Phase.REASONING:
            return 0
        for i, token in enumerate(drafts):
            if token == self.end_id:
                return i + 1
        return None
