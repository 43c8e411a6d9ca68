"""`jaxllm tune`: pick engine settings for a workload and its SLOs in the simulator (docs/tuning.md).

One job per module: `space` (what is searched), `capacity` (the objective: the highest sustainable request
rate), `search` (which settings are tried), `validate` (the top settings on a real server), `report` (JSON,
plots, the `jaxllm serve` command).
"""
