"""The search space: `--search NAME=V1,V2,...` parsed and checked against EngineArgs, and the default space,
restricted to the shapes the cost model was calibrated at (it records them in `CostModel.engine`)."""

from __future__ import annotations

import dataclasses
import logging
from itertools import product

from jaxllm.engine.args import EngineArgs
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.trace import TraceRequest

logger = logging.getLogger(__name__)

# engine arguments the simulator prices, and how their values parse; order = the order of a setting's keys
SEARCHABLE: dict[str, type] = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "scheduling_policy": str,
    "enable_prefix_caching": bool,
    "kv_cache_memory_bytes": int,
}
NUMERIC = ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes")

Setting = dict  # searched engine argument -> value


@dataclasses.dataclass
class Space:
    """Each searched argument's values (ascending for numbers, as given for the rest), and what was dropped."""

    values: dict[str, list]
    restricted: list[str] = dataclasses.field(default_factory=list)  # why values were left out, one line each

    def grid(self) -> list[Setting]:
        names = list(self.values)
        return [dict(zip(names, combo, strict=True)) for combo in product(*self.values.values())]

    @property
    def size(self) -> int:
        n = 1
        for v in self.values.values():
            n *= len(v)
        return n


def _parse_value(name: str, text: str):
    kind = SEARCHABLE[name]
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"--search {name}: {text!r} is not true or false")
    if kind is int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"--search {name}: {text!r} is not an integer") from None
        if value < 1:
            raise ValueError(f"--search {name}: values must be >= 1, got {value}")
        return value
    policy = text.strip()
    from jaxllm.engine.policy import resolve_policy

    try:
        resolve_policy(policy)
    except (ValueError, ImportError, AttributeError) as e:
        raise ValueError(f"--search {name}: {e}") from None
    return policy


def parse_search(items: list[str] | None) -> dict[str, list]:
    """`["max_num_seqs=4,8", "scheduling-policy=fcfs,sjf"]` -> {name: [values]} (dashes or underscores)."""
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    space: dict[str, list] = {}
    for item in items or ():
        raw_name, sep, raw_values = item.partition("=")
        name = raw_name.strip().lstrip("-").replace("-", "_")
        if not sep or not raw_values.strip():
            raise ValueError(f"--search takes NAME=V1,V2,... such as max_num_seqs=4,8; got {item!r}")
        if name not in fields:
            raise ValueError(f"--search {raw_name!r}: not an engine argument (EngineArgs has no field {name!r})")
        if name not in SEARCHABLE:
            raise ValueError(
                f"--search {name}: the simulator cannot price it; searchable: {', '.join(SEARCHABLE)} "
                f"(set other engine arguments with their own flags)"
            )
        if name in space:
            raise ValueError(f"--search {name} is given twice")
        values = []
        for text in raw_values.split(","):
            value = _parse_value(name, text)
            if value not in values:
                values.append(value)
        space[name] = sorted(values) if name in NUMERIC else values
    return space


def powers_of_two(upto: int, start: int = 1) -> list[int]:
    values, v = [], start
    while v <= upto:
        values.append(v)
        v *= 2
    return values


def default_policies(trace: list[TraceRequest]) -> list[str]:
    """fcfs and sjf always; priority, fair and lpm where the trace gives them something to act on."""
    policies = ["fcfs", "sjf"]
    if any(r.priority for r in trace):
        policies.append("priority")
    if len({r.user for r in trace if r.user is not None}) > 1:
        policies.append("fair")
    if any(r.prefix_group is not None for r in trace):
        policies.append("lpm")
    return policies


def build_space(explicit: dict[str, list], cost: CostModel, trace: list[TraceRequest], fixed: dict) -> Space:
    """The space searched: the `--search` dimensions, else the default ones (max_num_seqs, max_num_batched_tokens,
    scheduling_policy), every shape within what the cost model was calibrated at. `fixed` holds the engine
    arguments set by flags (a default dimension the user fixed with its own flag is not searched)."""
    seqs_cap = cost.engine.get("max_num_seqs")
    tokens_cap = max(cost.bucket_tokens)
    if "max_num_batched_tokens" in cost.engine:
        tokens_cap = min(tokens_cap, cost.engine["max_num_batched_tokens"])
    values: dict[str, list] = {}
    if explicit:
        values = {name: list(v) for name, v in explicit.items()}
    else:
        if fixed.get("max_num_seqs") is None:
            values["max_num_seqs"] = powers_of_two(seqs_cap or 8)
        if fixed.get("max_num_batched_tokens") is None:
            values["max_num_batched_tokens"] = powers_of_two(tokens_cap, start=8)
        if fixed.get("scheduling_policy") in (None, "fcfs"):
            values["scheduling_policy"] = default_policies(trace)
    restricted = []
    for name, cap, what in (
        ("max_num_seqs", seqs_cap, f"the cost model was calibrated at max_num_seqs={seqs_cap}"),
        ("max_num_batched_tokens", tokens_cap, f"the cost model measured step buckets up to {tokens_cap} tokens"),
    ):
        if name in values and cap is not None:
            dropped = [v for v in values[name] if v > cap]
            if dropped:
                values[name] = [v for v in values[name] if v <= cap]
                restricted.append(f"{name}: left out {dropped} ({what}; recalibrate at larger shapes to search them)")
    if not explicit:
        restricted.append(
            f"default space: max_num_seqs <= {seqs_cap}, max_num_batched_tokens <= {tokens_cap} "
            f"(the shapes the cost model covers)"
        )
    for line in restricted:
        logger.warning("search restricted: %s", line)
    empty = [name for name, v in values.items() if not v]
    if empty:
        raise ValueError(f"nothing left to search for {', '.join(empty)}: {'; '.join(restricted)}")
    return Space(values, restricted)


def valid(setting: Setting, fixed: dict, cost: CostModel) -> bool:
    """Whether the engine would accept it (max_num_batched_tokens >= max_num_seqs)."""
    seqs = setting.get("max_num_seqs", fixed.get("max_num_seqs") or cost.engine.get("max_num_seqs", 1))
    tokens = setting.get(
        "max_num_batched_tokens", fixed.get("max_num_batched_tokens") or cost.engine.get("max_num_batched_tokens", seqs)
    )
    return tokens >= seqs


def base_engine_args(given: EngineArgs, cost: CostModel) -> EngineArgs:
    """The engine arguments every setting starts from: the flags given, and for what they leave unset the
    calibrated engine's (dtype, max_model_len, shapes, and the KV pool's bytes: "KV memory from the machine")."""
    engine = cost.engine
    if given.pipeline_parallel_size != 1 or given.data_parallel_size != 1:
        raise ValueError("jaxllm tune searches one-device-group layouts only: leave out --pipeline/data-parallel-size")
    if given.speculative_config is not None:
        raise ValueError("jaxllm tune does not search speculation yet: leave out --speculative-config")
    if engine.get("pipeline_parallel_size", 1) != 1:
        raise ValueError("the cost model was calibrated with pipeline parallelism: calibrate with one stage")
    calibrated_tp = engine.get("tensor_parallel_size", 1)
    if given.tensor_parallel_size != calibrated_tp:
        raise ValueError(
            f"--tensor-parallel-size {given.tensor_parallel_size}: the cost model was calibrated at "
            f"tensor_parallel_size={calibrated_tp} (calibrate one per layout)"
        )
    updates: dict = {}
    if given.dtype == "auto" and "dtype" in engine:
        updates["dtype"] = engine["dtype"]
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(given, name) is None:
            if name not in engine:
                raise ValueError(f"--{name.replace('_', '-')} is needed: the cost model does not record it")
            updates[name] = engine[name]
    if given.kv_cache_memory_bytes is None:
        if "num_blocks" not in engine or "kv_bytes_per_block" not in engine:
            raise ValueError("--kv-cache-memory-bytes is needed: the cost model does not record its KV pool")
        updates["kv_cache_memory_bytes"] = engine["num_blocks"] * kv_bytes_per_block(cost, given.block_size)
    return dataclasses.replace(given, **updates)


def kv_bytes_per_block(cost: CostModel, block_size: int) -> int:
    per_block = cost.engine.get("kv_bytes_per_block")
    if per_block is None:
        raise ValueError("the cost model does not record kv_bytes_per_block: give --kv-cache-memory-bytes")
    return per_block * block_size // cost.engine.get("block_size", block_size)


def with_setting(base: EngineArgs, setting: Setting) -> EngineArgs:
    return dataclasses.replace(base, **setting)


def machine_differences(cost: CostModel, given: EngineArgs) -> list[str]:
    """What the cost model records that differs from this machine and these flags (one line each)."""
    import platform
    from pathlib import Path

    from jaxllm.sim.calibrate import machine_speed_keys

    engine, here = cost.engine, []
    checks = [
        ("machine", platform.node()),
        ("processor", platform.processor() or platform.machine()),
        *((key, value) for key, value in machine_speed_keys().items() if key in engine),  # newer models record them
    ]
    if given.model is not None:
        checks.append(("model", Path(given.model.rstrip("/")).name))
    if given.dtype != "auto":
        checks.append(("dtype", given.dtype))
    if given.quantization is not None:
        checks.append(("quantization", given.quantization))
    if given.kv_cache_dtype != "auto":
        checks.append(("kv_cache_dtype", given.kv_cache_dtype))
    for key, value in checks:
        recorded = engine.get(key)
        if recorded is None:
            if key in ("quantization", "kv_cache_dtype"):
                here.append(f"{key}: the cost model records none (calibrated without it), here {value!r}")
        elif str(recorded) != str(value):
            here.append(f"{key}: calibrated {recorded!r}, here {value!r}")
    return here
