"""Talk to `jaxllm serve` with the official `openai` client: a streaming chat, then a plain completion.

jaxllm serve                      # in one terminal (add --api-key KEY to require a key)
python examples/openai_client.py  # in another
"""

import os

from openai import OpenAI


def main(base_url: str = "http://127.0.0.1:8000/v1", api_key: str = "EMPTY") -> tuple[str, str]:
    client = OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    reply = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            reply += chunk.choices[0].delta.content
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    # vLLM's extra sampling fields (top_k, min_p, ignore_eos, ...) go in extra_body
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, extra_body={"top_k": 1}
    )
    print(repr(completion.choices[0].text), completion.usage)
    return reply, completion.choices[0].text


if __name__ == "__main__":
    main(os.environ.get("JAXLLM_BASE_URL", "http://127.0.0.1:8000/v1"), os.environ.get("JAXLLM_API_KEY", "EMPTY"))
