"""vLLM's `LoRARequest`: which adapter a request runs with."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique per adapter, and its PEFT folder.

    As in vLLM, requests are equal (and hash) by `lora_name`; `lora_int_id` names the adapter
    inside the engine (its host cache and device slot), so two adapters must not share one."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = dataclasses.field(default=None, compare=False)
    long_lora_max_len: int | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path.")
        if self.long_lora_max_len is not None:
            raise ValueError("long_lora_max_len (long-context LoRA) is not supported by jllm.")

    def __eq__(self, other) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
