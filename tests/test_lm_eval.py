"""lm-evaluation-harness scores a local multiple-choice task against a real `jaxllm serve`
(`local-completions`, the remote tokenizer through /tokenizer_info), and its per-choice
log-likelihoods equal transformers' on the same tokens (docs/evaluation.md)."""

import json
import subprocess
import sys

import torch

from jaxllm.bench.server_process import ServerProcess
from tests.test_cli_and_examples import ENGINE_FLAGS

ITEMS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "seven"], "answer": 0},
    {"question": "The color of the sky on a clear day is", "choices": ["green", "blue", "red"], "answer": 1},
]
TASK = """task: jaxllm_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context), split into tokens as lm-eval splits them (context + continuation encoded
    whole, the context's own tokens dropped)."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n = len(tokenizer.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(n, len(whole)))


def test_lm_eval_local_completions_logliks_equal_transformers(tmp_path, hf_default_model, default_model):
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "jaxllm_mc.yaml").write_text(TASK.format(data=data))
    with ServerProcess(ENGINE_FLAGS, log_path=tmp_path / "serve.log") as server:
        model_args = f"base_url={server.url}/v1/completions,model=SmolLM2-135M-Instruct,tokenizer_backend=remote"
        command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
        command += ["--tasks", "jaxllm_mc", "--include_path", str(tmp_path), "--log_samples"]
        command += ["--output_path", str(tmp_path / "out")]
        run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (samples,) = (tmp_path / "out").rglob("samples_jaxllm_mc_*.jsonl")
    scored = 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            ours = float(resp[0][0])
            expected = hf_loglikelihood(hf_default_model, default_model.tokenizer, args["arg_0"], args["arg_1"])
            assert abs(ours - expected) < 1e-3, (args, ours, expected)
            scored += 1
    assert scored == sum(len(item["choices"]) for item in ITEMS)


def test_the_tokenizer_alone_exports_for_eval_tools(tmp_path, default_model):
    from transformers import AutoTokenizer

    from jaxllm.entrypoints.convert import export_tokenizer

    exported = AutoTokenizer.from_pretrained(str(export_tokenizer(None, str(tmp_path / "tok"))))
    text = "Hello, world! The capital of France is Paris."
    assert exported.encode(text) == default_model.tokenizer.encode(text)
