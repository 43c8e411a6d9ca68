"""The search space: `--search NAME=V1,V2,...` parsed and checked against EngineArgs, and the default space,
restricted to the shapes the cost model was calibrated at (it records them in `CostModel.engine`).

Besides EngineArgs fields, `num_speculative_tokens` (vLLM's name inside `--speculative-config`) searches n-gram
speculation depth, 0 meaning none (`with_setting` turns it into `speculative_config`), and `router` the policy of
`jaxllm router` in front of `--instances N` equal instances (sim/cluster.py; not an engine argument: `with_setting`
leaves it out). Layouts: the simulator
splits a one-stage cost model over pipeline stages (`pipeline_parallel_size`); a tensor-parallel step is the cost
model's own (calibrated at one size), and data-parallel replicas with the front's routing are not simulated."""

from __future__ import annotations

import dataclasses
import json
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
    "num_speculative_tokens": int,  # n-gram speculation depth; 0: none
    "pipeline_parallel_size": int,
    "tensor_parallel_size": int,  # only the calibrated size: the cost model is one TP layout's
    "router": str,  # with --instances N > 1: the router's policy (jaxllm.routing), or "pd P:D" (sim/pd.py)
}
NUMERIC = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory_bytes",
    "num_speculative_tokens",
    "pipeline_parallel_size",
    "tensor_parallel_size",
)
SPECULATION = "num_speculative_tokens"
ROUTER = "router"
NOT_SIMULATED = {
    "data_parallel_size": "the simulator does not model data-parallel replicas and the front's routing between "
    "them (jaxllm/engine/dp_client.py); compare DP sizes on the real server (benchmarks/data_parallel.py)",
}

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
    if name == ROUTER:
        text = text.strip()
        if text.startswith("pd"):
            from jaxllm.sim.pd import parse_pd

            p, d = parse_pd(text.removeprefix("pd").strip())
            return f"pd {p}:{d}"
        from jaxllm.routing.registry import load_policy

        load_policy(text)  # an unknown policy: one line now
        return text
    if kind is int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"--search {name}: {text!r} is not an integer") from None
        least = 0 if name == SPECULATION else 1
        if value < least:
            raise ValueError(f"--search {name}: values must be >= {least}, got {value}")
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
        if name not in fields and name not in (SPECULATION, ROUTER):
            raise ValueError(f"--search {raw_name!r}: not an engine argument (EngineArgs has no field {name!r})")
        if name in NOT_SIMULATED:
            raise ValueError(f"--search {name}: {NOT_SIMULATED[name]}")
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


def serve_defaults(cost: CostModel) -> dict[str, int]:
    """`jaxllm serve`'s max_num_seqs and max_num_batched_tokens on the platform the cost model was calibrated on."""
    from jaxllm.engine.args import ACCELERATOR_DEFAULTS, CPU_DEFAULTS

    return dict(CPU_DEFAULTS if cost.engine.get("platform", "cpu") == "cpu" else ACCELERATOR_DEFAULTS)


def with_default(values: list[int], default: int, cap: int | None) -> list[int]:
    """`values` with serve's default among them where the cost model covers it (a user compares against it)."""
    if cap is not None and default > cap:
        return values
    return sorted({*values, default})


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


def default_routers(instances: int) -> list[str]:
    """Every router policy, and disaggregated prefill/decode splits "pd P:D" of the instances (all of them up to 8
    instances; above, P at eighths of N)."""
    from jaxllm.routing.registry import POLICIES

    splits = sorted({min(max(round(instances * k / 8), 1), instances - 1) for k in range(1, 8)})
    return [*POLICIES, *(f"pd {p}:{instances - p}" for p in splits)]


def default_values(
    cost: CostModel,
    trace: list[TraceRequest],
    fixed: dict,
    seqs_cap: int | None,
    tokens_cap: int,
    acceptance_known: bool,
) -> dict[str, list]:
    """The default dimensions a flag does not fix, from serve's defaults up to the calibrated shapes."""
    values: dict[str, list] = {}
    serve = serve_defaults(cost)
    if fixed.get("max_num_seqs") is None:
        values["max_num_seqs"] = with_default(powers_of_two(seqs_cap or 8), serve["max_num_seqs"], seqs_cap)
    if fixed.get("max_num_batched_tokens") is None:
        tokens = powers_of_two(tokens_cap, start=8)
        values["max_num_batched_tokens"] = with_default(tokens, serve["max_num_batched_tokens"], tokens_cap)
    if fixed.get("scheduling_policy") in (None, "fcfs"):
        values["scheduling_policy"] = default_policies(trace)
    if acceptance_known and fixed.get(SPECULATION) is None:
        values[SPECULATION] = [0, 1, 2, 4]
    return values


def build_space(
    explicit: dict[str, list],
    cost: CostModel,
    trace: list[TraceRequest],
    fixed: dict,
    *,
    acceptance_known: bool = False,
    instances: int = 1,
) -> Space:
    """The space searched: the `--search` dimensions, else the default ones (max_num_seqs, max_num_batched_tokens,
    scheduling_policy, and n-gram speculation depth when an acceptance rate is known: `acceptance_known`), every
    shape within what the cost model was calibrated at. `fixed` holds the engine arguments set by flags (a default
    dimension the user fixed with its own flag is not searched). With `instances` > 1 the router's policy is a
    dimension too (every registered policy by default)."""
    if ROUTER in explicit and instances < 2:
        raise ValueError("--search router: a router fronts several instances: give --instances N (N >= 2)")
    for router in explicit.get(ROUTER, []):
        if router.startswith("pd ") and sum(map(int, router.removeprefix("pd ").split(":"))) != instances:
            raise ValueError(f"--search router={router}: its prefill and decode instances must add up to --instances")
    seqs_cap = cost.engine.get("max_num_seqs")
    tokens_cap = max(cost.bucket_tokens)
    if "max_num_batched_tokens" in cost.engine:
        tokens_cap = min(tokens_cap, cost.engine["max_num_batched_tokens"])
    if explicit:
        values = {name: list(v) for name, v in explicit.items()}
    else:
        values = default_values(cost, trace, fixed, seqs_cap, tokens_cap, acceptance_known)
    if instances > 1 and ROUTER not in values:
        values[ROUTER] = default_routers(instances)
    restricted = []
    # a verification of k drafts is k + 1 rows of logits and tokens: beyond the calibrated rows (max_num_seqs)
    # the per-row cost would be extrapolated
    spec_cap = seqs_cap - 1 if seqs_cap is not None else None
    calibrated_tp = cost.engine.get("tensor_parallel_size", 1)
    for name, cap, what in (
        ("max_num_seqs", seqs_cap, f"the cost model was calibrated at max_num_seqs={seqs_cap}"),
        ("max_num_batched_tokens", tokens_cap, f"the cost model measured step buckets up to {tokens_cap} tokens"),
        (SPECULATION, spec_cap, f"a verification of k drafts has k + 1 rows; the cost model's steps had <= {seqs_cap}"),
    ):
        if name in values and cap is not None:
            dropped = [v for v in values[name] if v > cap]
            if dropped:
                values[name] = [v for v in values[name] if v <= cap]
                restricted.append(f"{name}: left out {dropped} ({what}; recalibrate at larger shapes to search them)")
    if "tensor_parallel_size" in values:
        dropped = [v for v in values["tensor_parallel_size"] if v != calibrated_tp]
        if dropped:
            values["tensor_parallel_size"] = [v for v in values["tensor_parallel_size"] if v == calibrated_tp]
            restricted.append(
                f"tensor_parallel_size: left out {dropped} (the cost model's steps are those of "
                f"tensor_parallel_size={calibrated_tp}; a TP step has its own sharded matmuls and all-reduces: "
                f"calibrate one cost model per size and tune with each)"
            )
    if "pipeline_parallel_size" in values and any(v > 1 for v in values["pipeline_parallel_size"]):
        layers = cost.engine.get("num_layers")
        split = f"by its {layers} layers" if layers else "evenly (the cost model records no num_layers)"
        restricted.append(
            f"pipeline_parallel_size: priced from the one-stage cost model split over the stages {split}, plus "
            f"the hidden states' copy per boundary, each stage on a device of its own as fast as the calibrated "
            f"one (docs/research.md); CPU host devices share the machine's cores, so on a CPU the prediction is "
            f"for P real devices, not for `jaxllm serve --pipeline-parallel-size` on this machine"
        )
    if SPECULATION in values and any(values[SPECULATION]) and not any(k.startswith("verify") for k in cost.fit):
        restricted.append(
            f"{SPECULATION}: the cost model timed no verification steps (calibrated before they were added): "
            f"a verification of k drafts is priced as a chunk of k + 1 tokens, which costs the same "
            f"(docs/research.md, verification steps in the cost model)"
        )
    if not explicit:
        restricted.append(
            f"default space: max_num_seqs <= {seqs_cap}, max_num_batched_tokens <= {tokens_cap} "
            f"(the shapes the cost model covers)"
            + ("" if acceptance_known else "; no speculation depth (no acceptance rate: --acceptance-rate)")
            + "; layouts: the calibrated one only (name pipeline_parallel_size in --search)"
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
    if given.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size: {NOT_SIMULATED['data_parallel_size']}")
    spec = given.speculative()  # parses (a clear error on bad JSON)
    if spec is not None and spec.method != "ngram":
        raise ValueError(
            f"--speculative-config: the simulator prices n-gram speculation only (method {spec.method!r} would "
            f"need its draft model's steps in the cost model)"
        )
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
    """The base arguments with the setting's values; `num_speculative_tokens` k becomes n-gram speculation with k
    drafts (the base's other n-gram fields kept), 0 none."""
    updates = dict(setting)
    updates.pop(ROUTER, None)
    if SPECULATION in updates:
        k = updates.pop(SPECULATION)
        spec = base.speculative()
        fields = json.loads(spec.to_json()) if spec is not None else {"method": "ngram"}
        updates["speculative_config"] = {**fields, SPECULATION: k} if k else None
    return dataclasses.replace(base, **updates)


def speculation_depth(args: EngineArgs) -> int:
    spec = args.speculative()
    return spec.num_speculative_tokens if spec is not None else 0


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
    if given.quantization not in (None, "auto"):
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
