#!/usr/bin/env python
"""Embeddings throughput (issue 50): inputs/s for `--input-len`-token inputs at batch 1 and batch 64, jaxllm's
pooling runner beside sentence-transformers and plain transformers on the same model, in the same run.

The model is the default one, SmolLM2-135M-Instruct: jaxllm runs its GGUF dequantized to float32 weights
(`--quantization none`, the very weights the peers run; `auto` keeps its Q4_1 blocks as `jaxllm serve` does) with
`runner="pooling"`, LAST pooling, L2-normalised (vLLM's default for a decoder); transformers reads the same GGUF
dequantized to float32 (`AutoModel`, `last_hidden_state[:, -1]`, normalised), and sentence-transformers
wraps that model saved as an HF directory (Transformer → Pooling(lasttoken) → Normalize), encoding the inputs'
text (its own tokenization, timed, as a user's call is). The three take turns round by round; reported: each
one's median inputs/s per batch size and the median of per-round ratios jaxllm / peer; each round's figures;
the cosine between jaxllm's and each peer's embedding of one sentence (the same model: ≈ 1, checked); the CPU and
the load average (`uptime`'s) before and after: the machine may be shared.

    python benchmarks/embeddings.py --rounds 3 --out benchmarks/results/embeddings_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def inputs(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` different inputs of exactly `length` tokens, cut from the held-out text."""
    text = (HERE.parent / "tests" / "data" / "heldout.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < count * length:
        ids += ids
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def save_float_copy(causal, tokenizer, folder: str) -> None:
    """The dequantized model as an HF directory (transformers will not `save_pretrained` a GGUF-loaded model)."""
    from safetensors.torch import save_file

    config = causal.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    # the tied head is the embedding: saved once, under the name the bare model (AutoModel) reads
    tensors = {k: v.contiguous().clone() for k, v in causal.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    # without its chat template: sentence-transformers 6 wraps a text in the template when the tokenizer has one
    # (a system prompt and a user turn: 35 tokens for a 9-token sentence), and the peers must embed the same tokens
    template, tokenizer.chat_template = tokenizer.chat_template, None
    tokenizer.save_pretrained(folder)
    tokenizer.chat_template = template


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--batch-1-inputs", type=int, default=8, help="inputs embedded one call at a time, per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="jaxllm's (default: its CPU default)")
    ap.add_argument(
        "--quantization",
        default="none",
        help="jaxllm's weights: none (the default: float32, the very weights the peers run), auto (the GGUF's Q4_1 "
        "blocks, as `jaxllm serve` runs it)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]

    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxllm import LLM
    from jaxllm.bench import offline
    from jaxllm.weights.default import default_model_path

    torch.set_num_threads(os.cpu_count() or 1)
    gguf = default_model_path()
    llm = LLM(
        runner="pooling",
        dtype="float32",
        max_model_len=args.input_len + 16,
        max_num_batched_tokens=args.max_num_batched_tokens,
        quantization=args.quantization,
        progress=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    causal = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    hf = causal.model
    with tempfile.TemporaryDirectory(prefix="jaxllm-embed-bench-") as folder:  # (0.5 GB: gone once loaded)
        save_float_copy(causal, tokenizer, folder)
        transformer = models.Transformer(folder)
    st = SentenceTransformer(
        modules=[transformer, models.Pooling(hf.config.hidden_size, pooling_mode="lasttoken"), models.Normalize()],
        device="cpu",
    )
    largest = max(args.batch_sizes)
    prompts = inputs(tokenizer, max(largest, args.batch_1_inputs), args.input_len)
    texts = [tokenizer.decode(p) for p in prompts]

    def run_jaxllm(batch: list[list[int]]) -> np.ndarray:
        outs = llm.embed([{"prompt_token_ids": p} for p in batch], use_tqdm=False)
        return np.asarray([o.outputs.embedding for o in outs])

    def run_transformers(batch: list[list[int]]) -> np.ndarray:
        with torch.inference_mode():
            hidden = hf(torch.tensor(batch)).last_hidden_state[:, -1].float()
        return torch.nn.functional.normalize(hidden, dim=-1).numpy()

    def run_st(batch_texts: list[str]) -> np.ndarray:
        return st.encode(batch_texts, batch_size=len(batch_texts), convert_to_numpy=True)

    engines = {  # name → embed the inputs at these indices, in one call
        "jaxllm": lambda idx: run_jaxllm([prompts[i] for i in idx]),
        "transformers": lambda idx: run_transformers([prompts[i] for i in idx]),
        "sentence_transformers": lambda idx: run_st([texts[i] for i in idx]),
    }
    # the same model: the same vector for one sentence (each tokenizes it alike; cosine ≈ 1)
    sentence = "Embeddings turn a text into one vector."
    first = {
        "jaxllm": np.asarray(llm.embed(sentence, use_tqdm=False)[0].outputs.embedding),
        "transformers": run_transformers([tokenizer.encode(sentence)])[0],
        "sentence_transformers": run_st([sentence])[0],
    }
    agreement = {
        peer: round(float(first["jaxllm"] @ v / (np.linalg.norm(first["jaxllm"]) * np.linalg.norm(v))), 6)
        for peer, v in first.items()
        if peer != "jaxllm"
    }
    if min(agreement.values()) < 0.999:
        sys.exit(f"the engines disagree on the first input's embedding (cosine with jaxllm's: {agreement})")

    def inputs_per_s(run, batch: int) -> float:
        """Batch 1: `--batch-1-inputs` calls of one input each; else one call of `batch` inputs."""
        calls = [[i] for i in range(args.batch_1_inputs)] if batch == 1 else [list(range(batch))]
        start = time.perf_counter()
        for call in calls:
            run(call)
        return sum(map(len, calls)) / (time.perf_counter() - start)

    for run in engines.values():  # warm: compiles, allocators, thread pools
        for batch in args.batch_sizes:
            run(list(range(batch)))
    rounds = []
    for index in range(args.rounds):
        row = {
            f"{name}_b{batch}": round(inputs_per_s(run, batch), 2)
            for batch in args.batch_sizes
            for name, run in engines.items()
        }
        print(json.dumps({"round": index, **row}), file=sys.stderr, flush=True)
        rounds.append(row)
    summary: dict = {}
    for batch in args.batch_sizes:
        summary[f"batch_{batch}"] = {
            "inputs_per_s": {n: round(statistics.median(r[f"{n}_b{batch}"] for r in rounds), 2) for n in engines},
            "jaxllm_over": {
                peer: offline.median_ratio(
                    [r[f"jaxllm_b{batch}"] for r in rounds], [r[f"{peer}_b{batch}"] for r in rounds]
                )
                for peer in engines
                if peer != "jaxllm"
            },
        }
    import sentence_transformers
    import transformers

    report = {
        "workload": {
            "input_len": args.input_len,
            "batch_sizes": args.batch_sizes,
            "batch_1_inputs_per_round": args.batch_1_inputs,
            "rounds": args.rounds,
            "pooling": "LAST, L2-normalised",
            "jaxllm_engine": {
                "max_num_seqs": llm.engine.config.scheduler.max_num_seqs,
                "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens,
                "weights": "float32 (the GGUF dequantized)"
                if args.quantization == "none"
                else f"quantization={args.quantization} (the GGUF's Q4_1 blocks), float32 activations",
            },
            "peers_weights": "the same GGUF dequantized to float32 (torch)",
        },
        "versions": {
            "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "machine": offline.machine_info(),
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpu_kernels": offline.cpu_kernel_info(llm),
        "cosine_with_jaxllm_one_sentence": agreement,
        "rounds": rounds,
        "summary": summary,
    }
    print(json.dumps(report, indent=2))
    offline.write_json(report, args.out)


if __name__ == "__main__":
    main()
