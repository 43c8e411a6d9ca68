"""The OpenAI-compatible HTTP server: `jaxllm serve` (routes in api_server.py, translation in serving_*.py)."""
