"""Serving metrics: per-step counts and per-request latencies (`stats`), exported to Prometheus
under vLLM's names with the `jaxllm:` prefix (`prometheus`) and logged every 10 s while busy (`loggers`)."""
