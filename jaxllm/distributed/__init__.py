"""Below the engine: the multi-host runtime (`jax.distributed`, a shared minimum), the leader -> follower step
broadcast, the supervisor and watchdog of a node, and the links that move arrays between processes. Data-parallel
replicas sit above the engine, in `engine/dp_client.py`."""
