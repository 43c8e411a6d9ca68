"""POST /tokenize, /detokenize and GET /tokenizer_info (vLLM's): the server's own tokenizer and chat
template, no generation. Long texts are tokenized off the event loop, as for generation."""

from __future__ import annotations

from typing import Any

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_engine import OpenAIServing

FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")  # paths on the server: not shared


class OpenAIServingTokenization(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat):
        super().__init__(
            chat.engine,
            chat.served_model_names,
            chat.request_logger,
            options=chat.options,
            tokenizer=chat.tokenizing,
            models=chat.models,
        )
        self.chat = chat  # renders conversations exactly as the chat endpoint does

    async def tokenize(self, request: TokenizeRequest) -> dict:
        self.check_model(request.model)
        tokenizer = self.require_tokenizer()
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", param="prompt")
        if request.messages is not None:
            chat = ChatCompletionRequest(
                messages=request.messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=request.tools,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
            )
            ids = (await self.chat.render(chat))["prompt_token_ids"]
        else:
            assert request.prompt is not None
            ids = await self.tokenizing.encode(request.prompt, request.add_special_tokens)
        response: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if request.return_token_strs:
            response["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return response

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        self.check_model(request.model)
        self.require_tokenizer()
        vocab = self.engine.info.vocab_size
        if any(not 0 <= t < vocab for t in request.tokens):
            raise bad_request(f"tokens must be token ids in [0, {vocab})", param="tokens")
        return {"prompt": await self.tokenizing.decode(request.tokens)}

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's configuration (as its tokenizer_config.json says it), its
        class, and the chat template the server applies; what remote tokenizers (lm-eval's) read."""
        tokenizer = self.require_tokenizer()
        init_kwargs = getattr(tokenizer, "init_kwargs", None) or {}
        config = {k: _plain(v) for k, v in init_kwargs.items() if k not in FILE_KEYS}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if config.get(key) is None and getattr(tokenizer, key, None) is not None:
                config[key] = str(getattr(tokenizer, key))
        config["tokenizer_class"] = type(tokenizer).__name__
        template = self.options.chat_template or tokenizer.chat_template
        if template:
            config["chat_template"] = template
        return config

    def require_tokenizer(self):
        if self.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        return self.engine.tokenizer


def _plain(value: Any) -> Any:
    """JSON-ready: an AddedToken is its text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
