"""LLM: the offline facade, as vLLM's — `LLM(model).generate(prompts, params)` and `.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.core import EngineCore
from jaxllm.lora.request import LoRARequest
from jaxllm.metrics.offline import OfflineMetrics, engine_stats
from jaxllm.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxllm.pooling.params import PoolingParams
from jaxllm.pooling.score import cosine, pair_up
from jaxllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxllm.engine.dp_client import DataParallelEngine
    from jaxllm.metrics.reader import Metric

PromptType = str | dict[str, Any]


def chat_prompt(
    tokenizer, conversation, chat_template: str | None = None, add_generation_prompt=True, chat_template_kwargs=None
):
    """One conversation as a prompt: the chat template's text and its token ids (the template writes the special
    tokens itself, so the tokenizer adds none); `chat_template_kwargs` go to the template (enable_thinking...)."""
    text = tokenizer.apply_chat_template(
        conversation,
        tokenize=False,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        **(chat_template_kwargs or {}),
    )
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


class LLM:
    """An engine for offline batch generation. `model=None` is the embedded default model.

    Engine settings are vLLM's (`max_num_seqs`, `max_num_batched_tokens`, `max_model_len`,
    `block_size`, `enable_prefix_caching`, `kv_cache_memory_bytes`, `gpu_memory_utilization`,
    `tensor_parallel_size`, `dtype`, `seed`, `load_format`, ...); see `EngineArgs`.
    """

    def __init__(self, model: str | None = None, *, progress: bool = True, **engine_args):
        args = EngineArgs(model=model, **engine_args)
        self.engine: EngineCore | DataParallelEngine
        if args.data_parallel_size > 1:  # one engine-core process per replica
            from jaxllm.engine.dp_client import DataParallelEngine

            self.engine = DataParallelEngine(args, progress=progress)
            model_name = self.engine.client.info.model
        else:
            self.engine = EngineCore(args, progress=progress)
            model_name = self.engine.loaded.name
        self._ids = itertools.count()
        self.runner = args.runner  # "generate" or "pooling" (embed, score)
        self._metrics = OfflineMetrics(model_name, len(engine_stats(self.engine)))  # what get_metrics() reads

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prompt prefix, e.g. between benchmark rounds; False while requests are running."""
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """vLLM's offline metrics API: everything `/metrics` would show for this engine, as objects (`Counter`,
        `Gauge`, `Vector`, `Histogram` of `jaxllm.metrics.reader`) with `name` (as on /metrics, without
        `_total`), `labels` and `value` / `values` / buckets; counted since the engine started. With
        speculation: `jaxllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and the
        Vector `..._num_accepted_tokens_per_pos`."""
        return self._metrics.snapshot(engine_stats(self.engine))

    # ---- generate --------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        A prompt is a string, `{"prompt": str}` or `{"prompt_token_ids": [...]}`. Every prompt (and LoRA adapter:
        one for all prompts, or one or None per prompt) is checked before any runs: a bad one raises `ValueError`
        and nothing is queued.
        """
        self._require_runner("generate", "generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._per_prompt(sampling_params, len(prompts), "sampling_params")
        priorities = self._per_prompt(priority, len(prompts), "priority", default=0)
        loras = self._per_prompt(lora_request, len(prompts), "lora_request") if lora_request else [None] * len(prompts)
        for lora in {lora for lora in loras if lora is not None}:
            if not isinstance(self.engine, EngineCore):
                raise ValueError("LoRA adapters are not supported with data_parallel_size > 1 yet")
            self.engine.add_lora(lora)
        encoded = self._encode_all(prompts)
        return self._run(encoded, params, priorities, loras, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        tokenizer = self._require_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            prompts.append(
                chat_prompt(tokenizer, conversation, chat_template, add_generation_prompt, chat_template_kwargs)
            )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # ---- embed and score (runner="pooling") ------------------------------------------------

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (`outputs.embedding`), in input order, batched through the same scheduler:
        each prompt is prefilled (in chunks when long), pooled, and its KV blocks freed. Needs runner="pooling"."""
        self._require_runner("pooling", "embed")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._per_prompt(pooling_params or PoolingParams(), len(prompts), "pooling_params")
        encoded = self._encode_all(prompts)
        outputs = self._run(encoded, params, [0] * len(prompts), [None] * len(prompts), use_tqdm)
        results = []
        for out in outputs:
            if out.embedding is None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error or 'no embedding'}")
            results.append(EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.embedding), out.prompt_token_ids))
        return results

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `score` for an embedding model: the cosine similarity of the embeddings of each pair, one
        text_1 against every text_2 (1-to-1, 1-to-N) or text_1[i] against text_2[i] (N-to-N)."""
        self._require_runner("pooling", "score")
        first = [text_1] if isinstance(text_1, (str, dict)) else list(text_1)
        second = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
        pairs = pair_up(first, second)
        embedded = self.embed(first + second, use_tqdm=use_tqdm)
        a, b = embedded[: len(first)], embedded[len(first) :]
        return [
            ScoringRequestOutput(
                str(n),
                ScoringOutput(cosine(a[i].outputs.embedding, b[j].outputs.embedding)),
                a[i].prompt_token_ids + b[j].prompt_token_ids,
            )
            for n, (i, j) in enumerate(pairs)
        ]

    # ---- helpers ---------------------------------------------------------------------

    def _require_runner(self, runner: str, method: str) -> None:
        if self.runner != runner:
            raise ValueError(f"LLM.{method} needs runner={runner!r}; this LLM was made with runner={self.runner!r}")

    def _encode_all(self, prompts: list) -> list:
        """Each prompt's (text, token ids), checked against max_model_len before any runs: ValueError naming it."""
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        for i, (_, ids) in enumerate(encoded):
            try:
                self.engine.validate_prompt(ids)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return encoded

    def _require_tokenizer(self):
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]} prompts")
        return self.engine.tokenizer

    def _encode(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer().encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self._require_tokenizer().encode(prompt["prompt"])
        raise ValueError(
            f"prompt {index}: expected a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, got {prompt!r:.80}"
        )

    @staticmethod
    def _per_prompt(value, count: int, name: str, default=None) -> list:
        if value is None:
            value = SamplingParams() if default is None else default
        if isinstance(value, (list, tuple)):
            if len(value) != count:
                raise ValueError(f"{name}: {len(value)} given for {count} prompts")
            return list(value)
        return [value] * count

    def _run(self, encoded, params, priorities, loras, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        ids = []
        try:
            for (text, token_ids), p, prio, lora in zip(encoded, params, priorities, loras, strict=True):
                request_id = str(next(self._ids))
                adapter = {"lora_request": lora} if lora is not None else {}  # (data-parallel engines take none)
                self.engine.add_request(request_id, token_ids, p, prompt=text, priority=prio, **adapter)
                ids.append(request_id)
            finished: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, unit="prompt") as bar:
                generated = 0
                while len(finished) < len(ids):
                    outputs = self.engine.step()
                    self._metrics.observe(outputs)
                    for output in outputs:
                        if output.finished:
                            finished[output.request_id] = output
                            generated += sum(len(c.token_ids) for c in output.outputs)
                            bar.update(1)
                            bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f} out tok/s")
            return [finished[i] for i in ids]
        finally:  # interrupted or failed: nothing stays queued, every block returns to the pool
            aborted = [self.engine.abort_request(request_id) for request_id in ids]
            self._metrics.observe([out for out in aborted if out is not None])
            if isinstance(self.engine, EngineCore):  # async scheduling: apply the last launched step now
                self._metrics.observe(self.engine.drain())
