"""vLLM's `prompt_embeds` payload read without PyTorch and without running anything: base64
of a `torch.save` file (what vLLM documents, read there with `torch.load(weights_only=True)`)
or of a safetensors file, holding one [tokens, hidden] float tensor.

A `torch.save` file is a zip: `<root>/data.pkl` (a pickle), `<root>/data/<key>` (each
storage's bytes) and `<root>/byteorder`. Its pickle names three globals for a tensor
(`torch._utils._rebuild_tensor_v2`, `torch.<Dtype>Storage`, `collections.OrderedDict`) and
one persistent id per storage; the unpickler here answers those names with its own
functions (numpy views of the storage bytes) and refuses every other name, so a payload
that would run code is a ValueError (a 400) before anything runs.
"""

from __future__ import annotations

import base64
import binascii
import collections
import io
import pickle
import zipfile

import ml_dtypes
import numpy as np
import safetensors.numpy

# torch's float storages -> numpy dtypes: prompt embeddings are float vectors.
STORAGES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64,
}
MAX_REASON = 200  # characters of a reader's own reason repeated to the caller


class _Storage:
    def __init__(self, name: str) -> None:
        self.dtype = np.dtype(STORAGES[name])


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, meta=None):
    """torch's `_rebuild_tensor_v2` on a numpy storage: a copy of the strided view, its
    reach checked against the storage first (as_strided would read past it)."""
    shape = tuple(int(s) for s in size)
    steps = tuple(int(s) for s in stride)
    if len(shape) != len(steps) or any(s < 0 for s in (*shape, *steps)) or int(offset) < 0:
        raise ValueError("a tensor's size, stride or offset is invalid")
    last = int(offset) + sum((n - 1) * s for n, s in zip(shape, steps, strict=True) if n)
    if 0 not in shape and last >= storage.shape[0]:
        raise ValueError("a tensor reaches past its storage")
    base = storage[int(offset) :]
    item = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(base, shape, tuple(s * item for s in steps))
    return np.array(view)


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, root: str, order: str) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.root, self.order = archive, root, order

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in STORAGES:
            return _Storage(name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"the payload names {module}.{name}, which is not a tensor's")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("an unknown persistent id")
        _, kind, key, _, numel = pid
        if not isinstance(kind, _Storage) or not isinstance(key, str) or "/" in key:
            raise pickle.UnpicklingError("an unknown storage")
        raw = self.archive.read(f"{self.root}/data/{key}")
        dtype = kind.dtype.newbyteorder("<" if self.order == "little" else ">")
        if len(raw) < int(numel) * dtype.itemsize:
            raise pickle.UnpicklingError("a storage is shorter than it says")
        return np.frombuffer(raw, dtype, int(numel)).astype(kind.dtype)


def _from_torch_zip(payload: bytes) -> np.ndarray:
    archive = zipfile.ZipFile(io.BytesIO(payload))
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
    if len(pickles) != 1:
        raise ValueError("not a torch.save file")
    root = pickles[0].removesuffix("/data.pkl")
    try:
        order = archive.read(f"{root}/byteorder").decode().strip()
    except KeyError:
        order = "little"
    return _TensorUnpickler(archive.read(pickles[0]), archive, root, order).load()


def load_prompt_embeds(data: str | bytes) -> np.ndarray:
    """The array of a base64 payload (ValueError for anything else); the engine checks it
    as every prompt's embeddings (engine/processor.py:prompt_embeds_array)."""
    try:
        payload = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError("`prompt_embeds` must be base64.") from e
    try:
        if payload.startswith(b"PK"):
            tensor = _from_torch_zip(payload)
        else:
            tensors = safetensors.numpy.load(payload)
            if len(tensors) != 1:
                raise ValueError(f"a safetensors payload holds one tensor, not {len(tensors)}")
            (tensor,) = tensors.values()
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - every reader failure is the payload's
        reason = (str(e).strip() or type(e).__name__)[:MAX_REASON]
        raise ValueError(
            f"`prompt_embeds` could not be deserialized as a tensor: {reason}"
        ) from None
    if not isinstance(tensor, np.ndarray):
        raise ValueError("`prompt_embeds` must be one tensor.")
    return tensor  # its shape, dtype and values: engine/processor.py's prompt_embeds_array
