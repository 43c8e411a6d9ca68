#!/usr/bin/env python
"""Peer: llama.cpp through llama-cpp-python, greedy, on the default model's GGUF.

All prompts share one llama.cpp context (one sequence id each, `n_seq_max` = batch, a KV
stream per sequence): prompts are prefilled in `--n-batch`-token chunks, then every step
decodes one token for every sequence in one `llama_decode` call, with greedy argmax over the
returned logits in numpy. EOS is never checked, so every sequence makes exactly
`--output-len` tokens. A timed run is prefill plus decode; loading the model is not timed.

The GGUF is the one shipped (Q4_1 matmul weights, a Q8_0 embedding / tied LM head) unless
`--dequantize f32|f16|bf16`: then llama.cpp's own converter (`llama_model_quantize`) writes the
same file with every tensor dequantized, once, into jaxllm's cache folder, and it is checked
against the `gguf` package's dequantization before use. `--dequantize f32` gives llama.cpp
exactly the float32 weights jaxllm computes with, `--dequantize bf16` the bfloat16 ones of
`dtype="bfloat16"` (the float32 values rounded to nearest even).
Needs `pip install llama-cpp-python` (it builds llama.cpp from source).

    python benchmarks/peers/llamacpp_generate.py --num-prompts 16 --input-len 128 --output-len 128
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from common import default_gguf, load_prompts, log, parser, report, time_runs

FTYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "f16": "LLAMA_FTYPE_MOSTLY_F16", "bf16": "LLAMA_FTYPE_MOSTLY_BF16"}


class BatchedDecoder:
    """A llama.cpp model and a context holding `num_seqs` sequences, driven through the C API."""

    def __init__(self, llama, path: str, num_seqs: int, ctx_per_seq: int, threads: int, n_batch: int):
        self.llama = llama
        llama.llama_backend_init()
        self.model = llama.llama_model_load_from_file(path.encode(), llama.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        params = llama.llama_context_default_params()
        params.n_ctx = ctx_per_seq * num_seqs
        params.n_batch = params.n_ubatch = max(n_batch, num_seqs)
        params.n_seq_max = num_seqs
        params.kv_unified = False  # one KV stream per sequence: a step attends to each sequence's own cells only
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not create a context for {num_seqs} sequences")
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.vocab_size = llama.llama_vocab_n_tokens(self.vocab)
        self.n_batch = params.n_batch
        self.batch = llama.llama_batch_init(self.n_batch, 0, 1)
        self.prefill_s = 0.0

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (self.llama.llama_token * (len(raw) + 16))()
        n = self.llama.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, False)
        if n < 0:
            raise RuntimeError("llama_tokenize: buffer too small")
        return list(buf[:n])

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """entries: (token, position, sequence, wants logits). Returns the wanted rows' logits, in order."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, wanted) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wanted
            b.seq_id[i][0] = seq
        if (rc := self.llama.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc} on a batch of {len(entries)} tokens")
        rows = sum(1 for e in entries if e[3])
        return np.ctypeslib.as_array(self.llama.llama_get_logits(self.ctx), shape=(rows, self.vocab_size))

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """`new_tokens` greedy tokens for every prompt: one prefill, then one batched decode per step."""
        start = time.perf_counter()
        self.llama.llama_memory_clear(self.llama.llama_get_memory(self.ctx), True)
        out: list[list[int]] = [[] for _ in prompts]
        flat = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        for first in range(0, len(flat), self.n_batch):
            chunk = flat[first : first + self.n_batch]
            logits = self._decode(chunk)
            for row, seq in enumerate(e[2] for e in chunk if e[3]):
                out[seq].append(int(np.argmax(logits[row])))
        self.prefill_s = time.perf_counter() - start
        for step in range(1, new_tokens):
            entries = [
                (toks[-1], len(p) + step - 1, s, True) for s, (p, toks) in enumerate(zip(prompts, out, strict=True))
            ]
            logits = self._decode(entries)
            for toks, token in zip(out, logits.argmax(axis=1).tolist(), strict=True):
                toks.append(token)
        return out


def dequantized_gguf(llama, source: Path, kind: str) -> Path:
    """`source` with every tensor dequantized to `kind` (f32 or f16), written once and verified."""
    from jaxllm.weights.default import cache_dir

    target = cache_dir() / "gguf" / f"{source.stem}-as-{kind.upper()}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    params = llama.llama_model_quantize_default_params()
    params.ftype = getattr(llama, FTYPES[kind])
    params.allow_requantize = True  # dequantize Q4_1 / Q8_0 tensors instead of refusing them
    params.quantize_output_tensor = True
    params.nthread = os.cpu_count() or 1
    log(f"[llama.cpp] writing {target} from {source}")
    if (rc := llama.llama_model_quantize(str(source).encode(), str(partial).encode(), params)) != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    check_dequantized(source, partial, kind)
    partial.replace(target)
    return target


def check_dequantized(source: Path, written: Path, kind: str) -> None:
    """Every tensor of `written` holds the `gguf` package's dequantization of `source`'s, in `kind`."""
    import ml_dtypes
    from gguf import GGUFReader
    from gguf.quants import dequantize

    want_type = kind.upper()
    originals = {t.name: t for t in GGUFReader(source).tensors}
    converted = GGUFReader(written).tensors
    if sorted(t.name for t in converted) != sorted(originals):
        raise SystemExit(f"{written}: the tensor names differ from {source}")
    for tensor in converted:
        if tensor.tensor_type.name not in (want_type, "F32"):
            raise SystemExit(f"{written}: {tensor.name} is {tensor.tensor_type.name}, expected {want_type}")
        original = originals[tensor.name]
        want, got = dequantize(original.data, original.tensor_type), np.asarray(tensor.data)
        if tensor.tensor_type.name == "BF16":  # the reader hands its raw bytes
            want, got = want.astype(ml_dtypes.bfloat16), got.view(ml_dtypes.bfloat16)
        if not np.array_equal(got.reshape(want.shape), want.astype(got.dtype)):
            raise SystemExit(f"{written}: {tensor.name} differs from the dequantized {source.name}")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--n-batch", type=int, default=512, help="llama.cpp n_batch / n_ubatch (prefill chunk)")
    ap.add_argument(
        "--dequantize",
        choices=sorted(FTYPES),
        default=None,
        help="run on the GGUF with every tensor dequantized to this type (f32, bf16: jaxllm's weights in that dtype)",
    )
    ap.add_argument("--output-tokens", default=None, help="write the last timed run's new token ids (JSON) here")
    args = ap.parse_args()
    try:
        import llama_cpp
        import llama_cpp._logger
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: pip install llama-cpp-python") from None
    llama_cpp._logger.set_verbose(False)

    path = Path(args.gguf) if args.gguf else default_gguf()
    if args.dequantize:
        path = dequantized_gguf(llama_cpp, path, args.dequantize)
    given = load_prompts(args, tokenize=None) if args.prompts else None
    num_seqs, longest = (len(given), max(map(len, given))) if given else (args.num_prompts, args.input_len)
    ctx_per_seq = -(-(longest + args.output_len) // 256) * 256  # llama.cpp pads each sequence's stream to 256 cells
    decoder = BatchedDecoder(llama_cpp, str(path), num_seqs, ctx_per_seq, args.threads, args.n_batch)
    prompts = given or load_prompts(args, decoder.tokenize)
    tokens: list[list[int]] = []

    def run(new_tokens: int) -> list[int]:
        nonlocal tokens
        tokens = decoder.generate(prompts, new_tokens)
        return [len(t) for t in tokens]

    latencies = time_runs(run, args)
    log(
        f"[llama.cpp] llama-cpp-python {llama_cpp.__version__} threads={args.threads} gguf={path.name} "
        f"prefill {decoder.prefill_s:.3f} s of the last run"
    )
    if args.output_tokens:
        Path(args.output_tokens).write_text(json.dumps(tokens))
    report("llama.cpp", llama_cpp.__version__, prompts, args, latencies, gguf=path.name)


if __name__ == "__main__":
    main()
