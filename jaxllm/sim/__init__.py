"""Scheduling research without a device: traces, a step-time cost model, and a simulator that
drives the engine's own Scheduler and KVCacheManager on a virtual clock. No JAX import here."""
