"""instructor 1.3 (openai<2) against a running server, from its own venv (it cannot share the test
extra's: instructor 1.3 pins openai<2). JSON_SCHEMA mode sends `{"type": "json_object", "schema": ...}`;
TOOLS mode a named tool_choice. Prints one JSON line per mode: the extracted City, the request body
sent, the client versions. tests/test_clients.py runs it (marked manual); docs/serving.md, Clients tried.

    python tests/clients/instructor13.py http://127.0.0.1:8000/v1 SmolLM2-135M-Instruct
"""

import json
import sys
from importlib.metadata import version

import httpx
import instructor
import openai
import pydantic

PROMPT = "Paris is the capital of France. Extract the city and its country."


class City(pydantic.BaseModel):
    name: str
    country: str


def main(base_url: str, model: str) -> None:
    sent: list[dict] = []
    client = openai.OpenAI(
        base_url=base_url,
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(event_hooks={"request": [lambda request: sent.append(json.loads(request.content))]}),
    )
    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        city = instructor.from_openai(client, mode=mode).chat.completions.create(
            model=model,
            response_model=City,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=60,
            temperature=0,
            max_retries=0,
        )
        record = {"mode": mode.value, "city": city.model_dump(), "sent": sent[-1]}
        print(json.dumps({**record, "instructor": version("instructor"), "openai": version("openai")}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
