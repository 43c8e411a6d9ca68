"""What a tune run is asked (`TuneJob`) and what both drivers start from (`prepare`: the trace, the cost model
and the engine arguments every setting starts from, checked), so the search and `--max-rate` read alike."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jaxllm.engine.args import EngineArgs
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.trace import TraceRequest

logger = logging.getLogger("jaxllm.tune")

NO_ACCEPTANCE = (
    "speculation needs an acceptance rate: give --acceptance-rate, or a trace whose records carry acceptance_rate "
    "(`jaxllm trace synth --acceptance-rate`)"
)


@dataclass(frozen=True)
class TuneJob:
    """The workload (a trace file), the cost model's file, the SLOs and the engine flags given."""

    trace: str
    cost: str
    slos: dict[str, float]
    engine: EngineArgs
    goodput_fraction: float = 0.99
    acceptance_rate: float | None = None  # n-gram speculation's, for records that carry none
    validate: int = 0  # settings to serve for real
    seed: int = 0
    output: str | None = None  # the result JSON's path
    instances: int = 1  # equal instances behind `jaxllm router` (> 1: the router's policy is searched too)

    def __post_init__(self):
        if self.instances < 1:
            raise ValueError(f"--instances must be >= 1, got {self.instances}")
        if self.instances > 1 and self.validate:
            raise ValueError(
                "--validate serves one instance; a cluster's prediction is checked by benchmarks/cluster_routing.py"
            )
        if self.validate < 0:
            raise ValueError(f"--validate must be >= 0, got {self.validate}")
        if self.acceptance_rate is not None and not 0 <= self.acceptance_rate <= 1:
            raise ValueError(f"--acceptance-rate must be in [0, 1], got {self.acceptance_rate}")

    def common_json(self, work: Workload) -> dict:
        """The keys every tune result starts with: the workload, the cost model, the SLOs."""
        return {
            "trace": self.trace,
            "num_requests": len(work.trace),
            "cost_model": self.cost,
            "goodput_slos_ms": self.slos,
            "goodput_fraction": self.goodput_fraction,
            "acceptance_rate": self.acceptance_rate,
            "cost_model_differences": work.differences,
        }

    def save(self, result: dict) -> None:
        if self.output:
            from jaxllm.tune.report import write_json

            write_json(result, self.output)
            print(f"result JSON: {self.output}")

    def slos_line(self) -> str:
        """The SLOs as the drivers' opening line gives them."""
        slos = " ".join(f"{k}:{v:g}" for k, v in self.slos.items())
        return f"SLOs {slos} ms for {self.goodput_fraction:.0%} of requests"


@dataclass(frozen=True)
class Workload:
    """A job's trace and cost model, loaded and checked against each other."""

    trace: list[TraceRequest]
    cost: CostModel
    base: EngineArgs  # the flags given, and the calibrated engine's values for what they leave unset
    differences: list[str]  # how this machine differs from the calibration's
    acceptance_known: bool  # every request has an acceptance rate (the job's or its record's)


def prepare(job: TuneJob) -> Workload:
    """Loads the job's cost model and trace; refuses an empty trace and one the calibrated engine cannot hold."""
    from jaxllm.sim.coverage import FROM_COST_MODEL, check_trace_fits
    from jaxllm.sim.trace import load_trace
    from jaxllm.tune.space import base_engine_args, machine_differences

    cost = CostModel.load(job.cost)
    trace = load_trace(job.trace)
    if not trace:
        raise ValueError(f"{job.trace}: the trace is empty")
    differences = machine_differences(cost, job.engine)
    for line in differences:
        logger.warning("the cost model was calibrated elsewhere: %s (predictions may not hold here)", line)
    base = base_engine_args(job.engine, cost)
    assert base.max_model_len is not None  # base_engine_args fills it
    source = "--max-model-len" if job.engine.max_model_len is not None else FROM_COST_MODEL
    check_trace_fits(trace, base.max_model_len, cost.engine, source=source, cost_path=job.cost)
    known = job.acceptance_rate is not None or all(r.acceptance_rate is not None for r in trace)
    return Workload(trace, cost, base, differences, known)
