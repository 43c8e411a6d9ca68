"""Batch generation with per-prompt SamplingParams on the default model (SmolLM2-135M-Instruct).

python examples/offline_inference.py
"""

from jaxllm import LLM, SamplingParams


def main(**engine_args) -> list:
    llm = LLM(**engine_args)  # no model named: the embedded default model
    tokenizer = llm.get_tokenizer()
    questions = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=32),  # greedy
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=32, seed=1),  # seeded sampling: reproducible
        SamplingParams(temperature=0.8, top_k=40, max_tokens=48, stop=["\n\n"], seed=2),
    ]
    outputs = llm.generate(prompts, params)
    for question, output in zip(questions, outputs, strict=True):
        completion = output.outputs[0]
        print(
            f"Q: {question}\nA: {completion.text.strip()}\n   ({len(completion.token_ids)} tokens, "
            f"finish_reason={completion.finish_reason})\n"
        )
    return outputs


if __name__ == "__main__":
    main()
