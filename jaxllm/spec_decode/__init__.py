"""Speculative decoding: drafts proposed on the host, verified by the target in one step.

See docs/speculative_decoding.md."""
