"""The models the server answers to: the base model's names and the LoRA adapters
(`--lora-modules`, and at run time `/v1/load_lora_adapter` / `/v1/unload_lora_adapter` when
vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is set). A request's `model` picks the adapter."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import threading

from jllm.entrypoints.openai.serving_engine import OpenAIError
from jllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """vLLM's `--lora-modules` item: `name=path`, or the JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if value.lstrip().startswith("{"):
        try:
            item = json.loads(value)
            return LoRAModulePath(item["name"], item["path"], item.get("base_model_name"))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"invalid JSON LoRA module {value!r}: {e}") from None
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"LoRA module {value!r} is not name=path or JSON.")
    return LoRAModulePath(name, path)


class ServingModels:
    def __init__(self, engine, base_names: list[str], root: str, lora_modules=()) -> None:
        self.engine = engine  # AsyncLLM
        self.base_names, self.root = list(base_names), root
        self.loras: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock = threading.Lock()  # runtime loads and unloads run on worker threads
        if lora_modules and self._cache is None:
            raise ValueError("--lora-modules needs --enable-lora.")
        for m in lora_modules:
            self.add(m.name, m.path, m.base_model_name)

    @property
    def _cache(self):
        return self.engine.engine.lora_cache

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load and check an adapter now (ValueError says what is wrong) and serve it."""
        request = LoRARequest(name, self._next_id, path, base_model_name=base_model_name)
        self._cache.get(request)
        self.loras[name] = request
        self._next_id += 1
        return request

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 if unknown."""
        if model is None or model in self.base_names:
            return None
        if model in self.loras:
            return self.loras[model]
        raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        card = dict(object="model", created=created, owned_by="jllm", max_model_len=max_model_len)
        base = [{**card, "id": n, "root": self.root, "parent": None} for n in self.base_names]
        return base + [
            {
                **card,
                "id": name,
                "root": r.lora_path,
                "parent": r.base_model_name or self.base_names[0],
            }
            for name, r in self.loras.items()
        ]

    def load(self, body: dict) -> str:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.", 400)
        if self._cache is None:
            raise OpenAIError("LoRA is not enabled: start the server with --enable-lora.", 400)
        with self._lock:
            if name in self.base_names:
                raise OpenAIError(
                    f"The lora adapter '{name}' conflicts with a served base model.", 400
                )
            if name in self.loras:
                raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", 400)
            if not os.path.exists(path):  # vLLM's 404 for an adapter that is not there
                raise OpenAIError(
                    f"Loading lora {name} failed: No adapter found for {path}", 404, "lora_path"
                )
            try:
                self.add(name, path, body.get("base_model_name"))
            except (ValueError, TypeError, OSError) as e:
                raise OpenAIError(str(e), 400) from e
        logger.info("Loaded LoRA adapter %r from %s.", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict) -> str:
        name = body.get("lora_name")
        if not name:
            raise OpenAIError("'lora_name' needs to be provided to unload a LoRA adapter.", 400)
        with self._lock:
            request = self.loras.pop(name, None)
        if request is None:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404)
        self._cache.remove(request.lora_int_id)  # running requests keep their copy
        logger.info("Unloaded LoRA adapter %r.", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
