"""The models a server serves (vLLM's OpenAIServingModels): the base model under its served names, and the LoRA
adapters, each a model of its own named by its `lora_name` (`--lora-modules` at start-up; with
JAXLLM_ALLOW_RUNTIME_LORA_UPDATING, /v1/load_lora_adapter and /v1/unload_lora_adapter while serving).

A request's `model` picks what runs: a base name (or none) the base model alone, an adapter's name that adapter,
anything else a 404. Adapters get ids 1, 2, ... in the order they are loaded; an id is never reused."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from pydantic import BaseModel

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.errors import OpenAIError
from jaxllm.entrypoints.openai.protocol import ModelCard, ModelList
from jaxllm.lora.request import LoRARequest

RUNTIME_LORA_ENV = "JAXLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING


def runtime_lora_updating() -> bool:
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served (read when the app is built)."""
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON `{"name", "path", "base_model_name"}`."""

    name: str
    path: str
    base_model_name: str | None = None


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str | None = None
    lora_int_id: int | None = None  # vLLM's field; the name decides


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")


class OpenAIServingModels:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]):
        self.engine = engine
        self.served_model_names = served_model_names
        self.loras: dict[str, LoRARequest] = {}  # by lora_name, in load order
        self._parents: dict[str, str] = {}  # lora_name → the model it adapts (its card's `parent`)
        self._last_id = 0
        self._lock = asyncio.Lock()  # loads and unloads, one at a time (made lazily on the serving loop)

    # ---- what a request's `model` selects -------------------------------------------------------------

    def is_known(self, model: str) -> bool:
        return model in self.served_model_names or model in self.loras

    def check_model(self, model: str | None) -> None:
        if model is not None and not self.is_known(model):
            raise model_not_found(model)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names; None for the base model (or no model). A 404 for an unknown name."""
        self.check_model(model)
        return self.loras.get(model) if model is not None else None

    def show_available_models(self) -> ModelList:
        info = self.engine.info
        names = self.served_model_names
        cards = [ModelCard(id=name, root=info.model, max_model_len=info.max_model_len) for name in names]
        cards += [
            ModelCard(id=name, root=lora.lora_path, parent=self._parents[name], max_model_len=info.max_model_len)
            for name, lora in self.loras.items()
        ]
        return ModelList(data=cards)

    # ---- loading and unloading --------------------------------------------------------------------------

    def _new_request(self, name: str, path: str) -> LoRARequest:
        if name in self.served_model_names:
            raise OpenAIError(f"The lora adapter name '{name}' is the base model's name.", param="lora_name")
        if name in self.loras:
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        return LoRARequest(name, self._last_id + 1, path)

    def _added(self, request: LoRARequest, parent: str | None) -> None:
        self.loras[request.lora_name] = request
        self._parents[request.lora_name] = parent or self.served_model_names[0]
        self._last_id = max(self._last_id, request.lora_int_id)

    def load_static(self, modules: list[LoRAModulePath], timeout: float | None = 600.0) -> None:
        """Load `--lora-modules` at start-up (blocking: no event loop runs yet); ValueError naming the module."""
        for module in modules:
            try:
                request = self._new_request(module.name, module.path)
                self.engine.add_lora_blocking(request, timeout)
            except OpenAIError as e:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {e.message}") from None
            except (ValueError, OSError) as e:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {e}") from None
            self._added(request, module.base_model_name)

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        """Read and check the adapter in the engine, then serve it: a 400 for anything the engine refused."""
        if not body.lora_name or not body.lora_path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.")
        async with self._lock:
            request = self._new_request(body.lora_name, body.lora_path)
            try:
                await self.engine.add_lora(request)
            except (ValueError, OSError) as e:
                message = f"Failed to load the lora adapter '{body.lora_name}': {e}"
                raise OpenAIError(message, param="lora_path") from None
            self._added(request, None)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        """Stop serving the adapter and forget it in the engine (requests running with it finish); 404 if unknown."""
        if not body.lora_name:
            raise OpenAIError("'lora_name' must be provided.", param="lora_name")
        async with self._lock:
            request = self.loras.get(body.lora_name)
            if request is None:
                raise OpenAIError(
                    f"The lora adapter '{body.lora_name}' cannot be found.", status=404, param="lora_name"
                )
            del self.loras[body.lora_name], self._parents[body.lora_name]
            await self.engine.remove_lora(request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
