"""LoRA adapters through the OpenAI-compatible server, as vLLM serves them: `--lora-modules` loaded at start-up,
each adapter a model of its own in /v1/models (parent: the base model) selected by a request's `model`; runtime
/v1/load_lora_adapter and /v1/unload_lora_adapter behind $JAXLLM_ALLOW_RUNTIME_LORA_UPDATING, with their 400s and
404s; the lora_requests_info gauge. One in-process server (test_lora.py's engine settings) for the module."""

import argparse
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from jaxllm import EngineArgs
from jaxllm.bench.server_process import free_port
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.cli import main
from jaxllm.entrypoints.cli.serve import lora_module
from jaxllm.entrypoints.openai.api_server import build_app
from jaxllm.entrypoints.openai.launcher import GracefulServer
from jaxllm.entrypoints.openai.serving_models import RUNTIME_LORA_ENV, LoRAModulePath, OpenAIServingModels
from tests.test_lora import ADAPTERS, ENGINE, make_adapter

BASE = "smol"
PROMPT = "The capital of France is"
GREEDY = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def paths(tmp_path_factory, hf_default_model):
    """Adapters on disk: two good ones (a1, a2), one of too high a rank, one with a broken config."""
    root = tmp_path_factory.mktemp("server_adapters")
    for name, key in (("a1", "all8"), ("a2", "qv16")):
        r, alpha, rslora, targets, seed = ADAPTERS[key]
        make_adapter(hf_default_model, root / name, r, alpha, rslora, targets, seed)
    shutil.copytree(root / "a1", root / "rank32")  # refused by its config's r, before any tensor is read
    config = json.loads((root / "a1" / "adapter_config.json").read_text())
    (root / "rank32" / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    shutil.copytree(root / "a1", root / "broken")
    (root / "broken" / "adapter_config.json").write_text("{not json")
    return root


@pytest.fixture(scope="module")
def server(paths):
    import uvicorn

    args = {k: v for k, v in ENGINE.items() if k != "progress"}
    engine = AsyncLLM(EngineArgs(**args), served_model_name=BASE, progress=False)
    modules = [LoRAModulePath("a1", str(paths / "a1")), LoRAModulePath("a2", str(paths / "a2"), "base-alias")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUNTIME_LORA_ENV, "true")
        app = build_app(engine, served_model_names=[BASE], lora_modules=modules)
    port = free_port()
    srv = GracefulServer(uvicorn.Config(app, port=port, log_level="warning", lifespan="off"), engine)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield engine, f"http://127.0.0.1:{port}", app.state.openai_serving_models
    srv.should_exit = True
    thread.join(timeout=30)
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[1], timeout=120) as c:
        yield c


def complete(client, model: str, stream: bool = False) -> str:
    if not stream:
        return client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text
    chunks = client.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_models_lists_adapters(client, paths):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[:3] == [BASE, "a1", "a2"]
    assert cards["a1"].root == str(paths / "a1") and cards["a1"].parent == BASE
    assert cards["a2"].parent == "base-alias"  # vLLM's base_model_name, as given
    assert getattr(cards[BASE], "parent", None) is None


def test_model_selects_the_adapter(client):
    texts = {m: complete(client, m) for m in (BASE, "a1", "a2")}
    assert texts["a1"] != texts[BASE]  # the adapter changes the greedy text
    logprobs = {
        m: client.completions.create(model=m, prompt=PROMPT, logprobs=0, **GREEDY).choices[0].logprobs.token_logprobs
        for m in (BASE, "a2")
    }
    assert logprobs["a2"] != pytest.approx(logprobs[BASE], abs=1e-3)  # a2 changes at least the logprobs
    for model, text in texts.items():
        assert complete(client, model, stream=True) == text  # streamed as not
    # all three at once (mixed in one batch): the same texts
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda m: complete(client, m), [BASE, "a1", "a2"] * 2))
    assert together == [texts[m] for m in [BASE, "a1", "a2"] * 2]
    # chat and responses take the adapter too: it changes their greedy reply
    chat = {
        m: client.chat.completions.create(model=m, messages=[{"role": "user", "content": "Hi"}], **GREEDY)
        .choices[0]
        .message.content
        for m in (BASE, "a1")
    }
    assert chat[BASE] != chat["a1"]
    replies = {
        m: client.responses.create(model=m, input="Hi", max_output_tokens=8, temperature=0) for m in (BASE, "a1")
    }
    assert replies[BASE].output_text != replies["a1"].output_text


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    r = http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_runtime_load_and_unload(server, client, http, paths):
    models = server[2]
    reference = complete(client, "a1")
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(paths / "a1")})
    assert r.status_code == 200 and "a3" in r.text, r.text
    cards = {m.id: m for m in client.models.list().data}
    assert cards["a3"].parent == BASE and cards["a3"].root == str(paths / "a1")
    assert complete(client, "a3") == reference  # the same weights as a1
    ids = {lora.lora_name: lora.lora_int_id for lora in models.loras.values()}
    assert ids == {"a1": 1, "a2": 2, "a3": 3}

    def load_error(body) -> str:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, (body, r.text)
        return r.json()["error"]["message"]

    assert "already been loaded" in load_error({"lora_name": "a3", "lora_path": str(paths / "a2")})
    assert "base model" in load_error({"lora_name": BASE, "lora_path": str(paths / "a2")})
    assert "no such LoRA adapter directory" in load_error({"lora_name": "x", "lora_path": str(paths / "missing")})
    assert "adapter_config.json" in load_error({"lora_name": "x", "lora_path": str(paths / "broken")})
    assert "rank" in load_error({"lora_name": "x", "lora_path": str(paths / "rank32")}).lower()
    assert "must be provided" in load_error({"lora_name": "x"})
    assert "x" not in {m.id for m in client.models.list().data}

    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 200 and "a3" in r.text
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        complete(client, "a3")
    # a new adapter gets a new id (one above the largest so far), and everything still serves
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a4", "lora_path": str(paths / "a2")})
    assert r.status_code == 200
    assert {lora.lora_name: lora.lora_int_id for lora in models.loras.values()}["a4"] == 4
    assert complete(client, "a4") == complete(client, "a2")
    assert complete(client, "a1") == reference


def test_lora_metrics(server, client, http):
    """vLLM's lora_requests_info: the running adapters (here a1, mid-stream) as a label, max_lora as another."""
    stream = client.completions.create(
        model="a1", prompt=PROMPT, stream=True, max_tokens=300, temperature=0, extra_body={"ignore_eos": True}
    )
    try:
        next(iter(stream))
        assert server[0].client.stats()[0]["lora"] == {"running": ["a1"], "waiting": [], "max_loras": 2}
        text = http.get("/metrics").text
    finally:
        stream.close()
    lines = [line for line in text.splitlines() if line.startswith("jaxllm:lora_requests_info{")]
    assert lines and all('max_lora="2"' in line and 'model_name="smol"' in line for line in lines), lines
    assert any('running_lora_adapters="a1"' in line and 'waiting_lora_adapters=""' in line for line in lines), lines


def test_engine_list_loras(server):
    engine, _, _ = server
    names = {lora.lora_name: lora.lora_int_id for lora in engine.client.list_loras().result(30)}
    assert names["a1"] == 1 and names["a2"] == 2


def test_runtime_routes_need_the_switch(server, monkeypatch):
    engine = server[0]
    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    paths = {getattr(r, "path", None) for r in build_app(engine, served_model_names=[BASE]).routes}
    assert "/v1/models" in paths and "/v1/load_lora_adapter" not in paths and "/v1/unload_lora_adapter" not in paths


def test_bad_module_fails_start_up(server, paths):
    engine = server[0]
    models = OpenAIServingModels(engine, [BASE])
    models._last_id = 100  # (this engine already has adapters 1, 2, ...: a server's first app starts at 1)
    with pytest.raises(ValueError, match=r"--lora-modules bad=.*missing: .*no such LoRA adapter directory"):
        models.load_static([LoRAModulePath("bad", str(paths / "missing"))])
    with pytest.raises(ValueError, match="--lora-modules big=.*rank"):
        models.load_static([LoRAModulePath("big", str(paths / "rank32"))])


def test_lora_modules_flag(capsys):
    assert lora_module("x=/p/q") == ("x", "/p/q", None)
    assert lora_module(json.dumps({"name": "x", "path": "/p", "base_model_name": "m"})) == ("x", "/p", "m")
    for bad in ("x", "=/p", '{"name": "x"}', '{"name": "x", "path": "/p", "rank": 2}', "{nope"):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module(bad)
    assert main(["serve", "--lora-modules", "x=/p"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
