"""Serve the default model from two Ray Serve replicas and ask them through the OpenAI client.

    pip install "jaxllm[ray]"
    python examples/ray_serve.py

Starts a local Ray cluster (or joins the one RAY_ADDRESS names), deploys two jaxllm replicas
with `jaxllm.integrations.ray_serve.build_app`, sends a chat and a completion to Ray's HTTP
proxy, prints the answers and which replica gave each, and shuts everything down.
"""

import ray
from openai import OpenAI
from ray import serve

from jaxllm.integrations.ray_serve import REPLICA_HEADER, build_app

# small batch shapes: few buckets to compile, so the replicas start in a minute or two on CPU
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)


def main(port: int = 8000, **engine) -> list[str]:
    ray.init()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({**ENGINE, **engine}, num_replicas=2), name="jaxllm", route_prefix="/")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY")
        model = client.models.list().data[0].id

        chat = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0,
        )
        completion = client.completions.with_raw_response.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0
        )

        answers = [chat.parse().choices[0].message.content, completion.parse().choices[0].text]
        for raw, answer in zip((chat, completion), answers, strict=True):
            print(f"replica {raw.headers[REPLICA_HEADER]}: {answer!r}")
        return answers
    finally:
        serve.shutdown()  # each replica stops its engine
        ray.shutdown()


if __name__ == "__main__":
    main()
