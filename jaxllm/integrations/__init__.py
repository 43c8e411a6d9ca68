"""Bridges to serving frameworks outside jaxllm (optional extras: `pip install jaxllm[ray]`)."""
