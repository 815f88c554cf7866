"""Weight transfer backends: how `update_weights` receives a trainer's tensors (vLLM's
`weight_transfer_config` and `init_weight_transfer_engine`).

- "jax" (the default): the trainer runs in the engine's process and hands the tensors
  themselves: (name, array) pairs or a mapping, as numpy arrays, torch tensors or
  `jax.Array`s on any devices, or the engine's own parameter state (`get_weights()`'s).
- "safetensors": a trainer in another process writes a safetensors file into the directory
  the config names (on /dev/shm it is shared memory) and sends its file name in
  `update_info` ({"file": "step-12.safetensors"}, optionally "delete": true). The engine
  reads it with safetensors: no pickle, nothing executed; a name that leaves the directory
  is refused.

Any backend also takes vLLM's request form: a dict {"update_info": {...}} or an object with
an `update_info` attribute.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

BACKENDS = ("jax", "safetensors")


class TransferConfig:
    def __init__(self, config: dict | None) -> None:
        config = dict(config or {})
        self.backend = config.pop("backend", "jax")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"weight_transfer_config backend {self.backend!r} is not one of {BACKENDS}."
            )
        self.dir = config.pop("dir", None)
        if self.backend == "safetensors" and not self.dir:
            raise ValueError('The "safetensors" weight transfer needs a "dir" to read from.')
        if config:
            raise ValueError(f"Unknown weight_transfer_config fields: {sorted(config)}.")
        self.initialized = self.backend == "jax"

    def init(self, init_info: Mapping | None) -> None:
        """`init_weight_transfer_engine`: nothing to connect for these backends; the
        safetensors backend may be pointed at its directory here too ({"dir": PATH}) when
        the config named none."""
        info = dict(init_info or {})
        if "dir" in info:
            if self.backend != "safetensors":
                raise ValueError(f'The {self.backend!r} weight transfer takes no "dir".')
            self.dir = info.pop("dir")
        if info:
            raise ValueError(f"Unknown init_info fields for {self.backend!r}: {sorted(info)}.")
        self.initialized = True

    def tensors(self, weights):
        """What `update_weights` was given, as (name, tensor) pairs or a mapping (or the
        engine's own state, passed through)."""
        info = None
        if isinstance(weights, Mapping) and set(weights) == {"update_info"}:
            info = weights["update_info"]
        elif hasattr(weights, "update_info"):
            info = weights.update_info
        if info is None:
            return weights
        if self.backend != "safetensors":
            raise ValueError(
                "update_info is the safetensors transfer's; this engine's weight transfer is "
                f"{self.backend!r}: pass the tensors themselves."
            )
        return self.read(info)

    def read(self, info) -> dict:
        if not isinstance(info, Mapping) or not isinstance(info.get("file"), str):
            raise ValueError(
                'update_info needs "file": a safetensors file name in the transfer directory.'
            )
        from safetensors.numpy import load_file

        root = os.path.realpath(self.dir)
        path = os.path.realpath(os.path.join(root, info["file"]))
        if os.path.dirname(path) != root:
            raise ValueError(f"update_info file {info['file']!r} is not in the transfer directory.")
        if not os.path.isfile(path):
            raise ValueError(f"update_info file {info['file']!r} does not exist.")
        tensors = load_file(path)
        if info.get("delete"):
            os.remove(path)
        return tensors
