"""What a simulation covers, said before and after it runs (`jaxllm simulate`, `jaxllm tune`).

Before: a trace whose requests need more than the engine's `max_model_len` (prompt + output, the rule a server
applies, vLLM's: it answers HTTP 400) is refused in one line that counts them and gives the `jaxllm calibrate`
command whose cost model would hold them; simulating it would only report failures that say nothing about
scheduling. After: the settings simulated, where each came from, and which lie beyond what the cost model
measured (extrapolated), so a reader knows what the figures describe.
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass

from jaxllm.sim.trace import TraceRequest

# where a setting came from, for the summary
FROM_COST_MODEL = "as calibrated"


@dataclass(frozen=True)
class TooLong:
    """The trace's requests that do not fit `max_model_len`."""

    count: int
    prompts_alone: int  # of them, prompts longer than max_model_len on their own
    longest: int  # the most tokens one request needs (prompt + output)
    max_model_len: int


def too_long(trace: list[TraceRequest], max_model_len: int) -> TooLong | None:
    """The requests needing more than `max_model_len` tokens, or None (text prompts, whose length only a
    tokenizer knows, are not counted: the simulator cannot run them anyway)."""
    needs = [(n, n + r.output_len) for r in trace if (n := r.num_prompt_tokens) is not None]
    over = [(prompt, total) for prompt, total in needs if total > max_model_len]
    if not over:
        return None
    return TooLong(
        count=len(over),
        prompts_alone=sum(prompt > max_model_len for prompt, _ in over),
        longest=max(total for _, total in over),
        max_model_len=max_model_len,
    )


def covering_len(tokens: int) -> int:
    """A context length that holds `tokens`: the next power of two (what one would calibrate at)."""
    return 1 << max(tokens - 1, 1).bit_length()


def calibrate_command(cost_path: str, engine: dict, max_model_len: int) -> str:
    """The `jaxllm calibrate` line for a cost model like `engine`'s (its dtype) at `max_model_len`; its other
    shapes are `jaxllm serve`'s defaults, as calibrate's are."""
    argv = ["jaxllm", "calibrate", "--out", cost_path, "--max-model-len", str(max_model_len)]
    if engine.get("dtype"):
        argv += ["--dtype", str(engine["dtype"])]
    return shlex.join(argv)


def check_trace_fits(
    trace: list[TraceRequest], max_model_len: int, engine: dict, *, source: str, cost_path: str = "cost.json"
) -> None:
    """Raise ValueError (one line) when some requests need more than `max_model_len` tokens; `source` says where
    the limit came from (`FROM_COST_MODEL` or the flag)."""
    over = too_long(trace, max_model_len)
    if over is None:
        return
    need = covering_len(over.longest)
    alone = f"; {over.prompts_alone} of them by the prompt alone" if over.prompts_alone else ""
    raise ValueError(
        f"{over.count} of {len(trace)} requests need more than max_model_len={max_model_len} tokens ({source}): "
        f"prompt + output, up to {over.longest}{alone}; a server refuses them (vLLM's rule). A cost model that holds "
        f"them: `{calibrate_command(derived_path(cost_path, need), engine, need)}` (or give --max-model-len {need} "
        f"to extrapolate this one's contexts)"
    )


def derived_path(cost_path: str, max_model_len: int) -> str:
    """`cost.json` -> `cost_4096.json`: where the covering calibration could go, beside the one given."""
    stem, dot, suffix = cost_path.rpartition(".")
    return f"{stem}_{max_model_len}.{suffix}" if dot and "/" not in suffix else f"{cost_path}_{max_model_len}"


def engine_line(settings: dict[str, object], given: set[str], engine: dict) -> str:
    """The engine simulated, one line: each setting, which ones flags gave (the rest are the cost model's
    engine's), and those beyond what the cost model measured."""
    shown = ", ".join(f"{name} {value}" for name, value in settings.items())
    calibrated = sorted(set(settings) - given)
    origin = f"from flags: {', '.join(sorted(given))}; " if given else ""
    origin += f"the rest {FROM_COST_MODEL}" if calibrated else ""
    line = f"engine simulated: {shown} ({origin})" if origin else f"engine simulated: {shown}"
    beyond = extrapolated(settings, engine)
    if beyond:
        line += f"; beyond the calibrated shapes (extrapolated): {', '.join(beyond)}"
    return line


def extrapolated(settings: dict[str, object], engine: dict) -> list[str]:
    """The settings larger than the calibrated engine's (its step times there are extrapolated)."""
    out = []
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        value, calibrated = settings.get(name), engine.get(name)
        if isinstance(value, int) and isinstance(calibrated, int) and value > calibrated:
            out.append(f"{name} {value} > {calibrated}")
    return out


def failure_line(errors: list[str | None]) -> str | None:
    """Why requests failed, grouped by reason (the text before an error's first colon), or None."""
    reasons = Counter(e.partition(":")[0] for e in errors if e)
    if not reasons:
        return None
    total = sum(reasons.values())
    parts = ", ".join(f"{n} {reason}" for reason, n in reasons.most_common())
    return f"{total} requests failed: {parts}"
