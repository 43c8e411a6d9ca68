#!/usr/bin/env python
"""Peer: llama.cpp through llama-cpp-python, greedy, on the default model's Q4_1 GGUF as shipped.

All prompts share one llama.cpp context (one sequence id each, `n_seq_max` = batch): prompts
are prefilled in `--n-batch`-token chunks, then every step decodes one token for every
sequence in one `llama_decode` call, with greedy argmax over the returned logits in numpy.
EOS is never checked, so every sequence makes exactly `--output-len` tokens.
Needs `pip install llama-cpp-python` (it builds llama.cpp from source).

    python benchmarks/peers/llamacpp_generate.py --num-prompts 16 --input-len 128 --output-len 128
"""

from __future__ import annotations

import numpy as np
from common import default_gguf, load_prompts, log, parser, report, time_runs


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
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = num_seqs
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit("llama.cpp could not create a context")
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.vocab_size = llama.llama_vocab_n_tokens(self.vocab)
        self.n_batch = n_batch
        self.batch = llama.llama_batch_init(max(n_batch, num_seqs), 0, num_seqs)

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (self.llama.llama_token * (len(raw) + 16))()
        n = self.llama.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, False)
        if n < 0:
            raise RuntimeError("llama_tokenize: buffer too small")
        return list(buf[:n])

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """entries: (token, position, sequence, wants logits). Returns the wanted rows' logits."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, wanted) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wanted
            b.seq_id[i][0] = seq
        if (rc := self.llama.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = sum(1 for e in entries if e[3])
        return np.ctypeslib.as_array(self.llama.llama_get_logits(self.ctx), shape=(rows, self.vocab_size))

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[int]:
        self.llama.llama_memory_clear(self.llama.llama_get_memory(self.ctx), True)
        last = [0] * len(prompts)
        flat = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        for start in range(0, len(flat), self.n_batch):
            chunk = flat[start: start + self.n_batch]
            logits = self._decode(chunk)
            for row, seq in enumerate(e[2] for e in chunk if e[3]):
                last[seq] = int(np.argmax(logits[row]))
        counts = [1] * len(prompts)
        for step in range(1, new_tokens):
            logits = self._decode([(last[s], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            last = [int(t) for t in logits.argmax(axis=1)]
            counts = [c + 1 for c in counts]
        return counts


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--n-batch", type=int, default=512, help="llama.cpp n_batch / n_ubatch (prefill chunk)")
    args = ap.parse_args()
    try:
        import llama_cpp
        import llama_cpp._logger
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: pip install llama-cpp-python") from None
    llama_cpp._logger.set_verbose(False)

    given = load_prompts(args, tokenize=None) if args.prompts else None
    num_seqs, longest = (len(given), max(map(len, given))) if given else (args.num_prompts, args.input_len)
    decoder = BatchedDecoder(llama_cpp, str(args.gguf or default_gguf()), num_seqs, longest + args.output_len + 16,
                             args.threads, args.n_batch)
    prompts = given or load_prompts(args, decoder.tokenize)
    latencies = time_runs(lambda n: decoder.generate(prompts, n), args)
    log(f"[llama.cpp] llama-cpp-python {llama_cpp.__version__} threads={args.threads}")
    report("llama.cpp", llama_cpp.__version__, prompts, args, latencies)


if __name__ == "__main__":
    main()
