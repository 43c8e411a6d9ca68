"""Scale-out: one model over several hosts (`jax.distributed`) and data-parallel engine replicas."""
