"""Quantized weights kept as their bits (GGUF blocks repacked at load)."""
