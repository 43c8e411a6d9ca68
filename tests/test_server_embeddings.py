"""The pooling server (--runner pooling): /v1/embeddings in OpenAI's shape (strings, token ids, base64, usage),
through the openai SDK and LangChain's OpenAIEmbeddings; /score and /rerank in vLLM's, Jina's and Cohere's shapes;
the 400s (empty, too long, `dimensions` on a model not Matryoshka-trained, each runner's routes on the other).
One pooling server for the module; the generate server is the session's."""

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import TEST_ENGINE
from tests.inprocess_server import MODEL, InProcessServer


@pytest.fixture(scope="module")
def pooling_server():
    s = InProcessServer(num_blocks=48, runner="pooling")
    yield s
    s.stop()


def post(server, path, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_embeddings_shape_usage_and_base64(pooling_server):
    tokenizer = pooling_server.engine.tokenizer
    texts = ["Hello world", "JAX compiles steps ahead of time."]
    r = post(pooling_server, "/v1/embeddings", {"model": MODEL, "input": texts, "user": "u1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    floats = [d["embedding"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1] and len(floats[0]) == 576
    assert abs(np.linalg.norm(floats[0]) - 1) < 1e-5
    b64 = post(pooling_server, "/v1/embeddings", {"input": texts, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][1]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, floats[1], atol=1e-6)
    ids = tokenizer.encode(texts[0])  # token ids, and lists of them, give the same vectors
    one = post(pooling_server, "/v1/embeddings", {"input": ids}).json()["data"][0]["embedding"]
    many = post(pooling_server, "/v1/embeddings", {"input": [ids, ids]}).json()["data"]
    np.testing.assert_allclose(one, floats[0], atol=1e-5)
    np.testing.assert_allclose(many[1]["embedding"], floats[0], atol=1e-5)
    stats = pooling_server.core.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_openai_sdk_and_langchain(pooling_server):
    client = openai.OpenAI(base_url=pooling_server.url + "/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model=MODEL, input=["a cat", "a dog"])  # the SDK asks for base64 and decodes it
    want = post(pooling_server, "/v1/embeddings", {"input": ["a cat", "a dog"]}).json()["data"]
    np.testing.assert_allclose(got.data[1].embedding, want[1]["embedding"], atol=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens > 0
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: LangChain sends the texts (else it tokenizes with tiktoken, a download)
    lc = OpenAIEmbeddings(
        model=MODEL, base_url=pooling_server.url + "/v1", api_key="unused", check_embedding_ctx_length=False
    )
    vectors = lc.embed_documents(["a cat", "a dog"])
    np.testing.assert_allclose(vectors[0], want[0]["embedding"], atol=1e-5)
    np.testing.assert_allclose(lc.embed_query("a dog"), want[1]["embedding"], atol=1e-5)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1] * (TEST_ENGINE["max_model_len"] + 1)}, "input"),
        ({"input": "hi", "dimensions": 32}, "dimensions"),
    ],
)
def test_embeddings_400s(pooling_server, body, param):
    r = post(pooling_server, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_runner_mismatch_is_400_naming_runner(pooling_server, server):
    r = post(pooling_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "--runner generate" in r.json()["error"]["message"]
    r = post(pooling_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "--runner generate" in r.json()["error"]["message"]
    for path, body in [
        ("/v1/embeddings", {"input": "hi"}),
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
    ]:
        r = post(server, path, body)
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], (path, r.text)


def test_score_and_rerank(pooling_server):
    docs = ["The cat sat on the mat.", "Stock markets fell today.", "A kitten naps on a rug."]
    embedded = post(pooling_server, "/v1/embeddings", {"input": ["a cat", *docs]}).json()["data"]
    vectors = [np.asarray(d["embedding"]) for d in embedded]
    want = [float(vectors[0] @ v) for v in vectors[1:]]  # unit vectors: the cosine is the dot product
    for path in ("/score", "/v1/score"):
        r = post(pooling_server, path, {"model": MODEL, "text_1": "a cat", "text_2": docs})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2] and data[0]["object"] == "score"
        np.testing.assert_allclose([d["score"] for d in data], want, atol=1e-5)
    pairs = post(pooling_server, "/score", {"text_1": docs[:2], "text_2": docs[:2]}).json()["data"]
    np.testing.assert_allclose([d["score"] for d in pairs], [1, 1], atol=1e-5)
    assert post(pooling_server, "/score", {"text_1": docs[:2], "text_2": docs}).status_code == 400
    best = int(np.argmax(want))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        documents = docs if path != "/v2/rerank" else [{"text": d} for d in docs]
        r = post(pooling_server, path, {"model": MODEL, "query": "a cat", "documents": documents, "top_n": 2})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == 2 and results[0]["index"] == best
        assert results[0]["document"]["text"] == docs[best]
        assert results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert r.json()["usage"]["total_tokens"] > 0
