"""Which settings are simulated: a coarse grid (every other value of each numeric argument, its ends kept, every
value of the others), then local refinement: the best setting's neighbours (one step along one argument) until
the best stops changing. No setting is simulated twice; the order is fixed, so the search is deterministic.
`full=True` tries the whole grid. Larger numeric values are tried first, so a good sustainable rate is known
early and the capacity search of settings that cannot reach it stops short (`Objective.capacity`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from jaxllm.engine.args import EngineArgs
from jaxllm.tune.capacity import Capacity
from jaxllm.tune.space import NUMERIC, Setting, Space


@dataclass
class Candidate:
    setting: Setting  # the searched arguments
    args: EngineArgs  # every engine argument
    capacity: Capacity

    @property
    def max_request_rate(self) -> float:
        return self.capacity.max_request_rate

    @property
    def mean_e2el_ms(self) -> float:
        return self.capacity.at_trace.summary["mean_e2el_ms"]

    def rank_key(self) -> tuple:
        """Higher sustainable rate; then lower mean E2E latency on the trace as given; then less memory (the KV
        pool, then the step's token budget and batch, which size the activations); then the setting's text."""
        a = self.args
        return (
            -self.max_request_rate,
            round(self.mean_e2el_ms, 6),
            a.kv_cache_memory_bytes,
            a.max_num_batched_tokens,
            a.max_num_seqs,
            json.dumps(self.setting, sort_keys=True),
        )


def coarse_indices(n: int) -> list[int]:
    return sorted({*range(0, n, 2), n - 1}) if n > 3 else list(range(n))


def search(
    space: Space,
    evaluate: Callable[[Setting], Candidate | None],
    *,
    full: bool = False,
    progress: bool = True,
) -> list[Candidate]:
    """Candidates tried, best first. `evaluate` returns None for a setting the engine would refuse."""
    names = list(space.values)
    tried: dict[tuple, Candidate | None] = {}

    def index_setting(idx: tuple) -> Setting:
        return {name: space.values[name][i] for name, i in zip(names, idx, strict=True)}

    bar = tqdm(total=space.size, desc="Tuning", unit="setting", disable=not progress)

    def run(indices: list[tuple]) -> None:
        for idx in indices:
            if idx not in tried:
                tried[idx] = evaluate(index_setting(idx))
                bar.update()

    def order(name: str, indices: list[int] | None) -> list[int]:
        """Largest numbers first (more batching tends to sustain more: a good bound early prunes the rest)."""
        if indices is None:
            return list(range(len(space.values[name])))
        return indices[::-1] if name in NUMERIC else indices

    def grid(choose: Callable[[str], list[int]]) -> list[tuple]:
        combos: list[tuple] = [()]
        for name in names:
            combos = [c + (i,) for c in combos for i in choose(name)]
        return combos

    try:
        if full:
            run(grid(lambda name: order(name, list(range(len(space.values[name]))))))
        else:
            run(grid(lambda name: order(name, coarse_indices(len(space.values[name])) if name in NUMERIC else None)))
            while True:
                valid = {idx: c for idx, c in tried.items() if c is not None}
                if not valid:
                    break
                best = min(valid, key=lambda i: valid[i].rank_key())
                neighbours = []
                for d, name in enumerate(names):
                    steps = (-1, 1) if name in NUMERIC else range(-len(space.values[name]), len(space.values[name]))
                    for delta in steps:
                        i = best[d] + delta
                        if delta and 0 <= i < len(space.values[name]):
                            neighbours.append(best[:d] + (i,) + best[d + 1 :])
                fresh = [idx for idx in neighbours if idx not in tried]
                if not fresh:
                    break
                run(fresh)
        bar.total = len(tried)
        bar.refresh()
    finally:
        bar.close()
    return sorted((c for c in tried.values() if c is not None), key=Candidate.rank_key)
