"""Incremental detokenization and stop strings with the real default tokenizer."""

import random

import pytest

from jaxllm.engine.detokenizer import IncrementalDetokenizer

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog.\n\nThen it  runs, twice:\tfast!",
    "emoji": "Nice 😀👍🏽 and 🇫🇷 flags 🎉🎉, family 👨‍👩‍👧 done",
    "cjk": "日本語のテキストと中文文本，还有한국어 텍스트。",
    "accented": "Café crème, naïve façade, Ångström, Dvořák, Øresund, straße",
}
PROMPT = "Write something:"


@pytest.fixture(scope="module")
def tok():
    from jaxllm.weights.default import default_model_path
    from jaxllm.weights.gguf import GGUFFile

    return GGUFFile(default_model_path()).tokenizer()


def stream(tok, ids, prompt_ids=None, **kwargs):
    """Feed ids one by one; returns (detokenizer, deltas, stop found, prefixes streamed after each step)."""
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT) if prompt_ids is None else prompt_ids, **kwargs)
    deltas, found = [], None
    for t in ids:
        found = d.update([t])
        deltas.append(d.get_delta())
        if found is not None:
            break
    if found is None:
        d.finish()
    deltas.append(d.get_delta())
    return d, deltas, found


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_token_by_token_equals_decode(tok, name):
    ids = tok.encode(TEXTS[name])
    if name in ("emoji", "cjk"):  # characters really are split over byte tokens here
        assert any("\ufffd" in tok.decode([t]) for t in ids)
    d, deltas, found = stream(tok, ids)
    assert found is None and d.finished
    assert d.output_text == tok.decode(ids, skip_special_tokens=True) == TEXTS[name]
    assert "".join(deltas) == d.output_text
    assert not any("\ufffd" in delta for delta in deltas)
    assert d.token_ids == ids


def test_leading_space_of_first_output_token(tok):
    prompt = tok.encode("The capital of France is")
    ids = tok.encode(" Paris. It is")
    d, deltas, _ = stream(tok, ids, prompt_ids=prompt)
    assert deltas[0] == " Paris" and d.output_text == " Paris. It is"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip):
    text = "<|im_start|>assistant\nHi there 😀<|im_end|>\n<|endoftext|>"
    ids = tok.encode(text)
    assert 1 in ids and 2 in ids and 0 in ids
    d, deltas, _ = stream(tok, ids, skip_special_tokens=skip)
    assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in d.output_text) is not skip
    assert "".join(deltas) == d.output_text


def test_random_ids_match_decode(tok):
    """Arbitrary ids (specials, lone byte tokens, invalid UTF-8) still end up exactly as decode."""
    rng = random.Random(0)
    byte_tokens = [t for t in range(len(tok)) if "\ufffd" in tok.decode([t])]
    for _ in range(5):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(len(tok)) for _ in range(200)]
        for skip in (True, False):
            d, deltas, _ = stream(tok, ids, skip_special_tokens=skip)
            assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == d.output_text


def check_stop(tok, text, stop, include, want_text, want_stop, chunk=1):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=stop, include_stop_str_in_output=include)
    streamed, found = "", None
    for i in range(0, len(ids), chunk):
        found = d.update(ids[i : i + chunk])
        streamed += d.get_delta()
        if found is not None:
            break
        # nothing streamed ever goes past what the final text keeps
        assert want_text.startswith(streamed), (streamed, want_text)
    if found is None:
        d.finish()
    streamed += d.get_delta()
    assert found == want_stop and d.stop_reason == want_stop
    assert d.output_text == want_text and streamed == want_text
    assert d.update(tok.encode(" more")) is None and d.output_text == want_text  # finished: ignored
    return d


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "Hello world, this is a test. Goodbye."
    ids = tok.encode(text)
    assert tok.decode(ids[:1]) == "Hello" and "o wor" not in tok.decode(ids[:1])  # "o wor" spans two tokens
    want = "Hello wor" if include else "Hell"
    check_stop(tok, text, "o wor", include, want, "o wor")
    check_stop(tok, text, ["nothing", "o wor"], include, want, "o wor", chunk=3)


@pytest.mark.parametrize("include", [False, True])
def test_several_stop_strings_earliest_wins(tok, include):
    text = "Hello world, this is a test. Goodbye."
    stops = ["test", "is a", "Goodbye"]
    check_stop(tok, text, stops, include, "Hello world, this is a" if include else "Hello world, this ", "is a")
    check_stop(
        tok,
        text,
        ["Goodbye", "."],
        include,
        "Hello world, this is a test." if include else "Hello world, this is a test",
        ".",
    )


def test_stop_string_with_multibyte_characters(tok):
    text = "Nice 😀👍🏽 and 日本語 done"
    check_stop(tok, text, "👍", False, "Nice 😀", "👍")
    check_stop(tok, text, "本語 d", True, "Nice 😀👍🏽 and 日本語 d", "本語 d")


def test_no_stop_releases_held_back_text_at_finish(tok):
    text = "Short answer."
    d = check_stop(tok, text, ["a very long stop string"], False, text, None)
    assert d.finished and d.stop_reason is None


def test_held_back_characters_while_unfinished(tok):
    ids = tok.encode("abcdefghij klmnop")
    d = IncrementalDetokenizer(tok, [], stop=["xyzw"])
    d.update(ids)
    assert d.output_text == "abcdefghij klmnop"
    assert d.get_delta() == "abcdefghij klm"  # len("xyzw") - 1 = 3 characters held back
    assert d.get_delta() == ""
    assert d.finish() is None
    assert d.get_delta() == "nop"


def test_finish_flushes_an_incomplete_character(tok):
    # the last token is half of a 4-byte character: finish() flushes it as U+FFFD, like decode
    ids = tok.encode(" 😀")
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    d.update(ids[:-1])
    assert d.output_text == "" and d.get_delta() == ""
    assert d.finish() is None
    assert d.output_text == tok.decode(ids[:-1]) and d.output_text.endswith("\ufffd")


def test_window_stays_small(tok):
    """O(1) per token: every decode call sees a short window, at most two calls per token."""
    ids = tok.encode(" ".join(TEXTS.values()) * 30)
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=["never appears"])
    sizes = []
    decode = d._decode_ids
    d._decode_ids = lambda window: sizes.append(len(window)) or decode(window)
    for t in ids:
        d.update([t])
        d.get_delta()
    d.finish()
    assert d.output_text == tok.decode(ids)
    assert max(sizes) <= 8 and len(sizes) <= 2 * len(ids) + 2
    assert len(d._ids) <= 200


def test_sentencepiece_style_leading_space():
    """A Metaspace tokenizer drops the space of the first token of a decode; the prompt context keeps it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert tok.decode([4, 5]) == "Paris."
    d = IncrementalDetokenizer(tok, [1, 2, 3])
    d.update([4, 5])
    assert d.output_text == " Paris."
    assert IncrementalDetokenizer(tok, []).update([4]) is None


def test_bad_stop_rejected(tok):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, [], stop=[""])
