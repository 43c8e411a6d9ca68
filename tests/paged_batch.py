"""Test helper: pack sequences into one ragged paged step, independently of the engine's runner."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxllm.model import StepInputs


def make_step(seqs, block_size: int, max_blocks: int, pad_tokens: int = 0, pad_seqs: int = 0) -> StepInputs:
    """`seqs`: list of (all_token_ids, num_computed, num_new, block_table).

    Computes tokens `num_computed : num_computed + num_new` of each sequence; logits are
    returned for every row, real rows first. Padding rows and sequences follow the kernel's contract.
    """
    tokens, positions, slots, cu, kv_lens, tables = [], [], [], [0], [], []
    for ids, done, new, table in seqs:
        for pos in range(done, done + new):
            tokens.append(ids[pos])
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        cu.append(cu[-1] + new)
        kv_lens.append(done + new)
        tables.append(list(table) + [0] * (max_blocks - len(table)))
    tokens += [0] * pad_tokens
    positions += [0] * pad_tokens
    slots += [0] * pad_tokens  # block 0 is the scratch block
    cu += [cu[-1]] * pad_seqs
    kv_lens += [0] * pad_seqs
    tables += [[0] * max_blocks] * pad_seqs
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    return StepInputs(
        token_ids=i32(tokens),
        positions=i32(positions),
        slot_mapping=i32([slots]),  # one KV cache group
        cu_q_lens=i32(cu),
        kv_lens=i32(kv_lens),
        block_tables=i32([tables]),
        num_seqs=i32([len(seqs)]),
        logits_indices=i32(np.arange(len(tokens))),  # every row; callers read the first real ones
    )
