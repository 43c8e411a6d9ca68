"""POST /tokenize and /detokenize (vLLM's): the server's own tokenizer and chat template, no generation."""

from __future__ import annotations

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat):
        super().__init__(chat.engine, chat.served_model_names, chat.max_log_len)
        self.chat = chat  # renders conversations exactly as the chat endpoint does

    def tokenize(self, request: TokenizeRequest) -> dict:
        self.check_model(request.model)
        tokenizer = self.require_tokenizer()
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", param="prompt")
        if request.messages is not None:
            chat = ChatCompletionRequest(messages=request.messages, add_generation_prompt=request.add_generation_prompt)
            ids = self.chat.render(chat)["prompt_token_ids"]
        else:
            ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def detokenize(self, request: DetokenizeRequest) -> dict:
        self.check_model(request.model)
        tokenizer = self.require_tokenizer()
        vocab = self.engine.info.vocab_size
        if any(not 0 <= t < vocab for t in request.tokens):
            raise bad_request(f"tokens must be token ids in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(request.tokens)}

    def require_tokenizer(self):
        if self.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        return self.engine.tokenizer
