"""Structured outputs on the default model: JSON schemas, regex, choice and a Lark grammar, greedy and
sampled; unconstrained neighbours untouched; preemption; bad constraints rejected before queueing."""

import json
import os
import re
import sys
import threading

import jsonschema
import lark
import pytest

from jaxllm import SamplingParams, StructuredOutputsParams
from jaxllm.runner.token_masks import all_allowed, allowed_token_ids

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = {
    "a person": {
        **OBJ,
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    "a user account": {
        **OBJ,
        "properties": {
            "user": {
                **OBJ,
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
                },
                "required": ["id", "email"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "a blog post's tags": {
        **OBJ,
        "properties": {
            "tags": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 12}}
        },
        "required": ["tags"],
    },
    "a t-shirt": {
        **OBJ,
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}},
        "required": ["color", "size"],
    },
    "a point": {
        **OBJ,
        "properties": {
            "x": {"type": "integer", "minimum": -10, "maximum": 10},
            "y": {"type": "integer", "minimum": 0, "maximum": 5},
        },
        "required": ["x", "y"],
    },
    "a flight": {
        **OBJ,
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "airport": {"type": "string", "pattern": "^[A-Z]{3}$"},
        },
        "required": ["date", "airport"],
    },
    "a book": {
        **OBJ,
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["title"],
    },
    "a shopping list": {
        **OBJ,
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    **OBJ,
                    "properties": {
                        "name": {"type": "string", "maxLength": 10},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["name", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    "a few scores": {
        "type": "array",
        "minItems": 2,
        "maxItems": 4,
        "items": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "an answer": {
        **OBJ,
        "properties": {
            "answer": {"type": "boolean"},
            "reason": {"type": "string", "maxLength": 40},
            "source": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 10}]},
        },
        "required": ["answer", "reason", "source"],
    },
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["Paris", "London", "Berlin", "Madrid"]
ARITHMETIC = r"""
start: expr
expr: term (OP term)~0..3
term: NUMBER | "(" expr ")"
OP: "+" | "-" | "*"
NUMBER: /[0-9]{1,3}/
"""
SAMPLING = {"greedy": dict(temperature=0), "t=0.8": dict(temperature=0.8)}


def chat(tokenizer, question):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def constrained(seed=0, max_tokens=96, sampling="greedy", **constraint):
    return SamplingParams(
        **SAMPLING[sampling], seed=seed, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**constraint)
    )


def cases():
    """(label, question, params, check) for every constraint kind, greedy and sampled."""
    out = []
    for sampling in SAMPLING:
        for i, (what, schema) in enumerate(SCHEMAS.items()):
            check = lambda text, schema=schema: jsonschema.validate(json.loads(text), schema)  # noqa: E731
            out.append(
                (
                    f"json {what} {sampling}",
                    f"Give me {what} as JSON.",
                    constrained(i, json=schema, sampling=sampling),
                    check,
                )
            )
        out.append(
            (
                f"regex {sampling}",
                "What is the phone number of the White House?",
                constrained(sampling=sampling, regex=PHONE),
                lambda text: _fullmatch(PHONE, text),
            )
        )
        out.append(
            (
                f"choice {sampling}",
                "Which city is the capital of France?",
                constrained(sampling=sampling, choice=CHOICES),
                lambda text: _one_of(text, CHOICES),
            )
        )
        out.append(
            (
                f"lark {sampling}",
                "Write an arithmetic expression that equals 10.",
                constrained(sampling=sampling, grammar=ARITHMETIC),
                lambda text: lark.Lark(ARITHMETIC, start="start").parse(text),
            )
        )
    return out


def _fullmatch(pattern, text):
    assert re.fullmatch(pattern, text), text


def _one_of(text, choices):
    assert text in choices, text


@pytest.fixture(scope="module")
def generated(llm):
    """Every case in one batch (the engine interleaves them, 8 at a time)."""
    tok = llm.get_tokenizer()
    llm.engine.structured._cache.clear()  # the session's engine: grammars other modules compiled are not counted
    all_cases = cases()
    outputs = llm.generate([chat(tok, q) for _, q, _, _ in all_cases], [p for _, _, p, _ in all_cases], use_tqdm=False)
    return [(label, check, o.outputs[0]) for (label, _, _, check), o in zip(all_cases, outputs, strict=True)]


def test_every_constraint_kind_gives_valid_output_that_ends_with_stop(generated):
    assert len(generated) == 2 * (len(SCHEMAS) + 3)
    for label, check, completion in generated:
        assert completion.finish_reason == "stop", (label, completion.text)
        check(completion.text)


def test_no_special_token_inside_constrained_text(llm, generated):
    tok = llm.get_tokenizer()
    special = set(tok.all_special_ids)
    for label, _, completion in generated:
        ids = completion.token_ids
        body = ids[:-1] if ids[-1] in llm.engine.eos_token_ids else ids
        assert not special & set(body), label


def test_matchers_are_freed_and_each_grammar_compiled_once(llm, generated):
    manager = llm.engine.structured
    assert manager.num_active == 0 and manager.num_pending == 0
    kinds = {kind for kind, _ in manager._cache}
    assert kinds == {"json", "regex", "choice", "grammar"}
    assert len(manager._cache) == len(SCHEMAS) + 3  # the sampled cases reused the greedy cases' grammars
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks


def test_unconstrained_requests_are_untouched_by_constrained_neighbours(llm):
    tok = llm.get_tokenizer()
    plain = [chat(tok, q) for q in ("Tell me a joke.", "What is 2+2?", "Name a color.")]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=5),
    ]
    alone = llm.generate(plain, params, use_tqdm=False)
    mixed_prompts = [plain[0], chat(tok, "Give me a person as JSON."), plain[1], chat(tok, "Pick a city."), plain[2]]
    mixed_params = [
        params[0],
        constrained(json=SCHEMAS["a person"]),
        params[1],
        constrained(sampling="t=0.8", choice=CHOICES),
        params[2],
    ]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [mixed[i].outputs[0].token_ids for i in (0, 2, 4)]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS["a person"])
    assert mixed[3].outputs[0].text in CHOICES


def test_grammar_end_finishes_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(
        temperature=0, max_tokens=64, ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    (output,) = llm.generate(chat(llm.get_tokenizer(), "Is the sky blue?"), params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].text in ("yes", "no")


def test_n_samples_each_follow_the_grammar(llm):
    params = SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=32, structured_outputs=StructuredOutputsParams(regex=r"[1-9][0-9]?")
    )
    (output,) = llm.generate(chat(llm.get_tokenizer(), "Pick a number."), params, use_tqdm=False)
    assert len(output.outputs) == 3
    for completion in output.outputs:
        assert re.fullmatch(r"[1-9][0-9]?", completion.text) and completion.finish_reason == "stop"


def test_preempted_and_recomputed_constrained_requests_stay_valid(llm):
    """Preempt constrained requests mid-output (as the scheduler does when the KV pool runs dry):
    they recompute prompt + output and carry on from where their matchers are."""
    engine, tok = llm.engine, llm.get_tokenizer()
    whats = ["a user account", "a t-shirt", "a person"]
    prompts = [tok.encode(chat(tok, f"Give me {w} as JSON.")) for w in whats]
    params = [constrained(json=SCHEMAS[w]) for w in whats]
    reference = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"preempt-{i}", p, sp)
    finished, preempted = {}, []
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        for request in list(engine.scheduler.running):
            if request.num_output_tokens in (2, 5) and request.num_preemptions < 2:
                engine.scheduler._preempt(request)
                preempted.append(request.request_id)
    assert sorted(set(preempted)) == sorted(finished) and len(preempted) > len(whats)
    for i, w in enumerate(whats):
        completion = finished[f"preempt-{i}"].outputs[0]
        assert completion.token_ids == reference[i].outputs[0].token_ids  # greedy: recompute changes nothing
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMAS[w])
    assert engine.structured.num_active == 0 and engine.kv.num_free_blocks == engine.kv.num_usable_blocks


def test_unconstrained_requests_run_while_a_grammar_compiles(llm):
    engine = llm.engine
    manager = engine.structured
    release = threading.Event()
    compile_grammar = manager._compile
    manager._compile = lambda grammar: release.wait(30) and compile_grammar(grammar)
    try:
        engine.add_request("slow-grammar", [1, 2, 3], constrained(regex="[a-z]{1,5}", max_tokens=8))
        engine.add_request("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        finished = {}
        while "plain" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
            assert engine.output_processor.groups["slow-grammar"][0].status.value == "waiting_for_fsm"
        assert engine.stats()["num_waiting_for_grammar"] == 1
        release.set()
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        manager._compile = compile_grammar
        release.set()
    assert re.fullmatch("[a-z]{1,5}", finished["slow-grammar"].outputs[0].text)
    assert manager.num_active == 0


def test_aborting_a_request_whose_grammar_compiles_forgets_it(llm):
    engine, manager = llm.engine, llm.engine.structured
    release = threading.Event()
    compile_grammar = manager._compile
    manager._compile = lambda grammar: release.wait(30) and compile_grammar(grammar)
    try:
        engine.add_request("aborted", [1, 2, 3], constrained(regex="[a-z]{2,7}"))
        assert manager.num_pending == 1
        output = engine.abort_request("aborted")
        assert output.finished and output.outputs[0].finish_reason == "abort"
        assert manager.num_pending == 0 and not engine.has_unfinished_requests()
    finally:
        release.set()
        manager._compile = compile_grammar
    assert engine.step() == [] and manager.num_active == 0


def test_bitmask_rows_match_the_matcher_and_allow_eos_only_at_the_end(llm):
    """fill_bitmask writes llguidance's mask in the sampler's packed layout (bit t%32 of word t//32)."""
    from jaxllm.request import Request
    from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput

    engine = llm.engine
    manager, vocab = engine.structured, engine.loaded.arch.vocab_size
    tok = llm.get_tokenizer()
    request = Request("mask-check", [1], constrained(choice=["yes", "no"]), engine.eos_token_ids)
    manager.add("mask-check", [request])
    manager.wait(timeout=30)
    assert manager.take_compiled() == [([request], None)]
    allowed = all_allowed(vocab, 4)
    row = ScheduledRequest(request, 1, 0, [])
    unconstrained = ScheduledRequest(Request("x", [1], SamplingParams()), 1, 0, [])
    rows = manager.fill_bitmask(SchedulerOutput(0, [unconstrained, row]).scheduled, allowed)
    assert rows == [1] and (allowed[0] == all_allowed(vocab)).all()
    first = {tok.decode([t]) for t in allowed_token_ids(allowed[1], vocab)}
    assert first and all("yes".startswith(s) or "no".startswith(s) for s in first)
    for token in tok.encode("yes", add_special_tokens=False)[:-1]:
        assert not manager.advance(request, token)
    assert manager.advance(request, tok.encode("yes", add_special_tokens=False)[-1])  # the grammar is complete
    manager.fill_bitmask(SchedulerOutput(0, [row]).scheduled, allowed)
    assert allowed_token_ids(allowed[0], vocab).tolist() == list(engine.eos_token_ids)
    manager.free(request)
    assert manager.num_active == 0


BAD = [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "StructuredOutputsParams.json"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="(unclosed"), "StructuredOutputsParams.regex"),
    (dict(grammar="start: undefined_rule"), "StructuredOutputsParams.grammar"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(json={"type": "object"}, regex="a+"), "exactly one of"),
    (dict(), "got none"),
    (dict(regex="a+", whitespace_pattern=" "), "whitespace_pattern applies only to json"),
    (dict(json_object=True, whitespace_pattern="[("), "StructuredOutputsParams.json_object"),
]


@pytest.mark.parametrize("constraint,message", BAD, ids=[m for _, m in BAD])
def test_bad_constraints_are_one_clear_error(constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**constraint)


def test_bad_params_queue_nothing_and_the_engine_serves_on(llm):
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a+"})
    prompts = ["Say a number:", "Say a word:"]
    with pytest.raises(ValueError, match="prompt 1"):  # one bad prompt: nothing of the call is queued
        llm.generate([prompts[0], {"prompt_token_ids": []}], constrained(regex="[0-9]{1,3}"), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.structured.num_pending == 0
    outputs = llm.generate(prompts, [constrained(regex="[0-9]{1,3}"), SamplingParams(max_tokens=4)], use_tqdm=False)
    assert re.fullmatch("[0-9]{1,3}", outputs[0].outputs[0].text) and len(outputs[1].outputs[0].token_ids) == 4


def test_a_grammar_that_fails_to_compile_fails_only_its_request(llm):
    engine = llm.engine
    manager = engine.structured
    compile_grammar = manager._compile

    def broken(grammar):
        raise ValueError("simulated compile failure")

    manager._compile = broken
    try:
        params = constrained(regex="[0-9]{1,2}[a-z]")  # a grammar no other test compiled (not cached)
        outputs = llm.generate(["Hi", "Hello"], [params, SamplingParams(max_tokens=3)], use_tqdm=False)
    finally:
        manager._compile = compile_grammar
        manager._cache.clear()
    assert outputs[0].outputs[0].finish_reason == "error" and "simulated compile failure" in outputs[0].error
    assert len(outputs[1].outputs[0].token_ids) == 3 and outputs[1].error is None
    assert not engine.has_unfinished_requests() and manager.num_active == manager.num_pending == 0


def test_json_is_compact_unless_a_whitespace_pattern_is_given(llm):
    tok = llm.get_tokenizer()
    prompt = chat(tok, "Give me a point as JSON.")
    compact, spaced = llm.generate(
        [prompt, prompt],
        [constrained(json=SCHEMAS["a point"]), constrained(json=SCHEMAS["a point"], whitespace_pattern=" ")],
        use_tqdm=False,
    )
    assert not re.search(r"\s", compact.outputs[0].text)
    jsonschema.validate(json.loads(spaced.outputs[0].text), SCHEMAS["a point"])


def test_json_object_gives_any_json_object(llm):
    question = 'Reply in JSON with the keys "city" and "country": where is the Eiffel Tower?'
    (output,) = llm.generate(
        chat(llm.get_tokenizer(), question), constrained(json_object=True, max_tokens=64), use_tqdm=False
    )
    assert output.outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(output.outputs[0].text), dict)


def test_no_compilation_with_constraints(llm, generated):
    from jaxllm.runner.compilations import compilation_count

    before = compilation_count()
    llm.generate(["Pick:"], constrained(choice=CHOICES), use_tqdm=False)
    assert compilation_count() == before  # masks go into the sampler's existing `allowed` rows


def test_example_runs(llm, capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import structured_outputs

    outputs = structured_outputs.main(llm)
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * 4
    jsonschema.validate(json.loads(outputs[0].outputs[0].text), structured_outputs.PERSON)
    assert "parsed:" in capsys.readouterr().out
