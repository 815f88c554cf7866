"""Multi-LoRA: adapters served from one base model, mixed in one batch (vLLM's LoRA API).

- `request.py`: `LoRARequest`, vLLM's (`lora_name`, `lora_int_id`, `lora_path`).
- `peft.py`: a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`)
  read, checked against the base model and converted to the engine's layout on the host,
  with a digest of its content (the prefix cache's key).
- `layers.py`: the device side: every targeted projection's stacked slot arrays and the delta
  `scale * (x @ A[slot]) @ B[slot]` inside the jitted step.
- `manager.py`: the host cache of loaded adapters (LRU, `max_cpu_loras`) and the device
  slots (`max_loras`) the scheduler hands out.

The package needs no model and imports nothing from jllm/models/: the model's `Linear` calls
the delta from here, and installing the slot arrays into a model is the model's side
(jllm/models/lora.py).
"""
