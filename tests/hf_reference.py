"""transformers-side references for the end-to-end tests."""

import torch


def hf_greedy(model, prompt, num_tokens):
    """Greedy argmax with a KV cache, EOS included (generate() would stop at it or suppress it)."""
    out, ids = None, torch.tensor([prompt])
    generated = []
    with torch.no_grad():
        for _ in range(num_tokens):
            out = model(ids, cache=out.cache if out else None, use_cache=True)
            generated.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[generated[-1]]])
    return generated


def hf_log_softmax(model, token_ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].double(), -1).numpy()
