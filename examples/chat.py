"""A multi-turn chat with the default model: each reply is fed back into the conversation.

python examples/chat.py
"""

from jaxllm import LLM, SamplingParams


def main(**engine_args) -> list[dict]:
    llm = LLM(**engine_args)
    params = SamplingParams(temperature=0, max_tokens=48)
    conversation = [{"role": "system", "content": "You are a concise assistant."}]
    for question in ["What is the largest planet in the solar system?", "How many moons does it have?"]:
        conversation.append({"role": "user", "content": question})
        reply = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text.strip()
        conversation.append({"role": "assistant", "content": reply})
        print(f"user: {question}\nassistant: {reply}\n")
    return conversation


if __name__ == "__main__":
    main()
