"""Structured outputs: JSON that follows a schema, a regex, one of a few choices, a Lark grammar.

    python examples/structured_outputs.py

Each constraint is a `StructuredOutputsParams` (vLLM's fields); the output is valid by
construction and the request ends ("stop") as soon as the constraint is complete.
"""

import json

from jaxllm import LLM, SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "languages": {"type": "array", "items": {"enum": ["English", "French", "German", "Spanish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
SENTENCE = r"""
start: subject " " verb " " object "."
subject: "The cat" | "A dog" | "My friend"
verb: "eats" | "sees" | "likes"
object: "fish" | "the ball" | NUMBER " apples"
NUMBER: /[1-9][0-9]?/
"""


def main(llm: LLM | None = None, **engine_args) -> list:
    llm = llm or LLM(**engine_args)
    tokenizer = llm.get_tokenizer()
    asks = [
        ("Describe a famous scientist as JSON.", StructuredOutputsParams(json=PERSON)),
        ("What is the phone number of the White House?", StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}")),
        ("Is Paris the capital of France?", StructuredOutputsParams(choice=["yes", "no"])),
        ("Write a short sentence about a pet.", StructuredOutputsParams(grammar=SENTENCE)),
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        for question, _ in asks
    ]
    params = [SamplingParams(temperature=0, max_tokens=100, structured_outputs=constraint) for _, constraint in asks]
    outputs = llm.generate(prompts, params)
    for (question, constraint), output in zip(asks, outputs, strict=True):
        completion = output.outputs[0]
        print(f"Q: {question}\n   [{constraint.kind}] {completion.text}  (finish_reason={completion.finish_reason})")
    print("parsed:", json.loads(outputs[0].outputs[0].text))
    return outputs


if __name__ == "__main__":
    main()
