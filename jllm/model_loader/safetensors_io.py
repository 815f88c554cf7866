"""Reading Hugging Face safetensors checkpoints as float32 numpy arrays, without torch.

safetensors' own numpy API cannot hand out bfloat16 tensors (numpy has no such type), and most
checkpoints on the hub are bfloat16. The format is simple enough to read directly: an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then
the raw data. We memory-map the file, view each byte range with the matching numpy dtype
(ml_dtypes supplies bfloat16 and the float8 types) and convert to float32, so a tensor costs one
copy and nothing is read twice.
"""

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod

import ml_dtypes
import numpy as np

# safetensors dtype tag -> numpy dtype; its `.name` is what `checkpoint_dtype` reports
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}

# Integer tensors: the packed codes of AWQ/GPTQ checkpoints, read only for them.
_INT_DTYPES: dict[str, np.dtype] = {"I32": np.dtype(np.int32), "U8": np.dtype(np.uint8)}

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file."""

    name: str
    dtype: str  # the safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # byte offset from the start of the file
    end: int


def read_header(path: str) -> list[TensorEntry]:
    """The tensors of one safetensors file, in on-disk order."""
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file.")
        header_len = int.from_bytes(prefix, "little")
        if header_len > file_size - 8:
            raise ValueError(
                f"{path} is not a valid safetensors file (header length out of range)."
            )
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        entry = TensorEntry(name, info["dtype"], shape, data_start + begin, data_start + end)
        if entry.end > file_size:
            raise ValueError(f"{path}: tensor {name!r} extends past the end of the file.")
        entries.append(entry)
    return sorted(entries, key=lambda e: e.start)


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a model directory, honouring a shard index when there is one.

    The index matters for repos that ship both sharded files and a `consolidated.safetensors`
    (Mistral's): only the files the index names belong to the transformers checkpoint.
    """
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
        if missing:
            raise ValueError(
                f"{index_path} names shards that are not in {model_dir}: {missing}. "
                "The download is incomplete; fetch the missing files."
            )
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    return [os.path.join(model_dir, n) for n in names]


def iter_safetensors(
    files: list[str], integers: bool = False, fp8: bool = False
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(name, float32 array)` for every tensor of every file, in file order.

    integers: int32 and uint8 tensors (AWQ/GPTQ packed codes, MXFP4 blocks and scales) come as
    they are stored instead of being refused. fp8: float8 tensors (an FP8 checkpoint's codes)
    come as stored, not widened."""
    for path in files:
        entries = read_header(path)
        if not entries:
            continue
        blob = np.memmap(path, mode="r", dtype=np.uint8)
        for entry in entries:
            dtype = _DTYPES.get(entry.dtype)
            if integers and entry.dtype in _INT_DTYPES:
                dtype = _INT_DTYPES[entry.dtype]
            if dtype is None:
                raise ValueError(
                    f"{path}: tensor {entry.name!r} has dtype {entry.dtype}; only floating point "
                    f"checkpoints are supported ({', '.join(_DTYPES)}), not quantized ones."
                )
            if entry.end - entry.start != prod(entry.shape) * dtype.itemsize:
                raise ValueError(
                    f"{path}: tensor {entry.name!r} has a byte size that does not match its "
                    f"shape {entry.shape} and dtype {entry.dtype}; the file is corrupt."
                )
            raw = blob[entry.start : entry.end].view(dtype).reshape(entry.shape)
            if dtype.kind in "iu" or (fp8 and entry.dtype.startswith("F8")):
                yield entry.name, np.asarray(raw)
                continue
            # float32 stays a read-only view of the map; everything else is converted (one copy).
            yield entry.name, np.asarray(raw).astype(np.float32, copy=False)


def dtype_name(tag: str) -> str:
    """numpy/jnp name of a safetensors dtype tag: "BF16" -> "bfloat16"."""
    dtype = _DTYPES.get(tag)
    return dtype.name if dtype is not None else tag.lower()


def count_params(files: list[str]) -> tuple[int, int]:
    """`(number of elements, bytes of tensor data on disk)` over all files, from the headers."""
    params = nbytes = 0
    for path in files:
        for entry in read_header(path):
            params += prod(entry.shape)
            nbytes += entry.end - entry.start
    return params, nbytes
