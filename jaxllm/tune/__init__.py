"""`jaxllm tune`: pick engine settings for a workload and its SLOs in the simulator (docs/tuning.md).

One job per module: `job` (what a run is asked, its trace and cost model loaded and checked), `tuner` (the search
driver), `max_rate` (the `--max-rate` driver), `space` (what is searched), `capacity` (the objective: the highest
sustainable request rate), `search` (which settings are tried), `validate` (the top settings on a real server),
`report` (JSON, plots, the `jaxllm serve` command). Nothing here imports the CLI: `jaxllm/entrypoints/cli/tune.py`
parses flags into a `TuneJob` and calls a driver.
"""
