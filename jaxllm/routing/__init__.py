"""Router policies for N equal instances: which instance serves a request (`jaxllm router --instances`).

A policy is a small class behind one interface (base.py) that sees a plain-Python view of the instances (view.py:
load numbers, health, and the block hash → instances index that KV events feed: kv_events/index.py) and returns
one instance. No HTTP here: the HTTP router (entrypoints/router/balancer.py) feeds the view from the instances, and
a simulator can feed the same view from its virtual instances. One file per policy: round_robin, least_loaded,
session, prefix_aware; `registry.load_policy` takes a name or a dotted path to a user's own class.
"""
