#!/usr/bin/env python
"""Peer: transformers `generate` (static batch, greedy, PyTorch on CPU, float32) on the default model.

transformers reads the same GGUF jaxllm does and dequantizes it to float32. The batch is
padded on the left only if the prompts differ in length (the standard workload's do not).
Every row makes exactly `--output-len` tokens (min_new_tokens = max_new_tokens).

    python benchmarks/peers/transformers_generate.py --num-prompts 16 --input-len 128 --output-len 128
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from common import default_gguf, load_prompts, log, parser, report, time_runs  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    gguf = args.gguf or str(default_gguf())
    folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, args.dtype)).eval()
    prompts = load_prompts(args, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])

    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                pad_token_id=pad,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
            )
        return [out.shape[1] - width] * len(prompts)

    latencies = time_runs(run, args)
    log(
        f"[transformers] {transformers.__version__} torch {torch.__version__} threads={torch.get_num_threads()} "
        f"attention={model.config._attn_implementation}"
    )
    report("transformers", transformers.__version__, prompts, args, latencies)


if __name__ == "__main__":
    main()
