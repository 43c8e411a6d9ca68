"""The n-gram proposer (prompt lookup): drafts copied from where the context's suffix last appeared before.

Each request keeps an index from every n-gram of its tokens (n in [min, max]) to where its earliest occurrence
ends, extended by each new token: proposing costs O(max - min + 1) dictionary lookups a step whatever the
context's length, where a rescan would cost the whole context (vLLM #16883).
"""

from __future__ import annotations

from jaxllm.request import Request


class NgramIndex:
    """The n-grams of one token sequence, n in [lo, hi], each mapped to the end of its earliest occurrence."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.tokens: list[int] = []
        self.first_end: dict[tuple[int, ...], int] = {}  # n-gram → index one past its earliest occurrence

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(self.lo, min(self.hi, end) + 1):
                self.first_end.setdefault(tuple(self.tokens[end - n : end]), end)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the earliest earlier occurrence of the longest matching suffix."""
        end = len(self.tokens)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            at = self.first_end.get(tuple(self.tokens[end - n : end]))
            if at is not None and at < end:  # an occurrence before the suffix itself
                return self.tokens[at : at + k]
        return []


class NgramProposer:
    """Drafts for every request from its own prompt and output, through an `NgramIndex` per request."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self._index: dict[str, NgramIndex] = {}

    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        return [self._propose_one(request, k) for request in requests]

    def _propose_one(self, request: Request, k: int) -> list[int]:
        index = self._index.get(request.request_id)
        if index is None or len(index.tokens) > request.num_tokens:  # new, or cut back (a stop string): afresh
            index = self._index[request.request_id] = NgramIndex(self.lo, self.hi)
        known = len(index.tokens)
        if known < request.num_prompt_tokens:
            index.extend(request.prompt_token_ids[known:])
        index.extend(request.output_token_ids[len(index.tokens) - request.num_prompt_tokens :])
        return index.propose(k)

    def free(self, request_id: str) -> None:
        self._index.pop(request_id, None)
