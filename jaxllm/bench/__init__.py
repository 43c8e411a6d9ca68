"""Benchmarks behind `jaxllm bench`: result JSON with vLLM's keys."""
