"""KV events: what an engine's prefix cache stores and drops, published for routers (vLLM's `--kv-events-config`).

events (the schema and its wire form), publisher (the engine side: one batch per engine step, to an in-process
sink or a ZeroMQ PUB socket with a replay socket), subscriber (the reading side: sequence numbers checked, gaps
replayed or the view marked stale), index (block hash → instances, longest-prefix match). Host side: no JAX.
"""
