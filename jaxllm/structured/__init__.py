"""Structured outputs: grammar-constrained decoding with llguidance.

- `grammar.py`    constraint (JSON schema, regex, choice, Lark/GBNF) → checked llguidance grammar
- `tokenizer.py`  the llguidance tokenizer from the model's HF fast tokenizer
- `manager.py`    per-request matchers, compile pool and cache, batch bitmask fill
- `openai.py`     OpenAI `response_format` / `tools` / `tool_choice` / vLLM `structured_outputs`
                  → `StructuredOutputsParams`, and generated tool-call text → OpenAI `tool_calls`
"""
