"""The llguidance tokenizer, built from the model's own HF fast tokenizer (its Rust JSON).

Special tokens (chat markers and the like) are never allowed inside constrained text:
llguidance only admits them where a grammar names them. The EOS ids given here are the
engine's, so a grammar's end allows exactly the tokens the scheduler stops on.
"""

from __future__ import annotations


def tokenizer_problem(hf_tokenizer) -> str | None:
    """Why structured outputs cannot run with this tokenizer, or None when they can."""
    if hf_tokenizer is None:
        return "structured outputs need a tokenizer, and this model has none"
    if getattr(hf_tokenizer, "backend_tokenizer", None) is None:
        return "structured outputs need a fast (Rust `tokenizers`) tokenizer; this model's is a slow one"
    return None


def llguidance_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """An `LLTokenizer` whose masks are `vocab_size` bits wide (ids past the tokenizer's are never allowed).

    Takes ~0.5 s for a 50k vocabulary, so the engine builds it once, off the step loop.
    """
    import llguidance.hf

    if (problem := tokenizer_problem(hf_tokenizer)) is not None:
        raise ValueError(problem)
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
