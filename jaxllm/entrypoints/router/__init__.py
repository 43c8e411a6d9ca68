"""`jaxllm router`: one OpenAI-compatible front for disaggregated prefill and decode instances, or for N equal
instances under a routing policy (`--instances`: balancer.py, the policies in jaxllm/routing/).

Each request is prefilled on a prefill instance (`max_tokens` 1, which hands back
`kv_transfer_params`) and then generated on a decode instance that receives those params, as
vLLM's P/D proxy does. app.py holds the routes, proxy.py the two phases and their fallbacks,
instances.py the pools (least-loaded choice), metrics.py the router's Prometheus collectors.
"""
