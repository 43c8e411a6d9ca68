"""KV connectors: KV moved between the device cache and host memory, storage, or another engine (P/D).

docs/disaggregated.md tells how to use them; base.py is the interface; factory.py builds one.
"""
