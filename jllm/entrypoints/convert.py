"""`jllm convert MODEL OUT`: the engine's parameters as an orbax checkpoint
(`model_loader/orbax_io.py`), which `LLM(OUT)` and `jllm serve OUT` restore straight into
their shardings instead of converting a Hugging Face or GGUF checkpoint on every start.

The weights are saved as the engine holds them after loading: in `--dtype`, quantized by
`--quantization` (fp8, tpu_int8, or a GGUF file's blocks with gguf), with the kv heads
repeated as `--tensor-parallel-size` needs. The config, tokenizer, processor and generation
config are copied beside them.
"""

from __future__ import annotations

import argparse
import logging
import os

logger = logging.getLogger("jllm")


def convert(
    model: str | None,
    out: str,
    dtype: str = "auto",
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    trust_remote_code: bool = False,
) -> str:
    import jax

    from jllm.config import EngineArgs
    from jllm.engine.generation_config import model_generation_config
    from jllm.engine.model_setup import load_engine_model
    from jllm.model_loader import orbax_io
    from jllm.models import registry

    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"{out} exists and is not empty; jllm convert writes a new folder.")
    args = EngineArgs(
        model=model,
        dtype=dtype,
        quantization=quantization,
        tensor_parallel_size=tensor_parallel_size,
        trust_remote_code=trust_remote_code,
    )
    m = load_engine_model(args, jax.devices()[0].platform)
    source = m.source
    os.makedirs(out, exist_ok=True)
    source.hf_config.save_pretrained(out)
    if m.tokenizer is not None:
        m.tokenizer.save_pretrained(out)
    generation = model_generation_config(source)
    if generation is not None:
        generation.save_pretrained(out)
    if getattr(m.config, "vision", None) is not None:
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(source.path).save_pretrained(out)
    meta = {
        "architecture": registry.resolve(source.hf_config).name,
        "dtype": m.dtype.name,
        "quantization": m.quantization,
        "kv_replicas": m.kv_replicas,
        "tensor_parallel_size": tensor_parallel_size,
        "source": source.path,
    }
    orbax_io.save(out, m.state, meta)
    logger.info("Converted %s to %s (%s).", source.path, out, meta)
    return out


def add_parser(commands) -> None:
    p = commands.add_parser(
        "convert",
        help="Save a model's weights as jllm's orbax checkpoint.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="A Hugging Face folder, a cached hub id or a .gguf file.")
    p.add_argument("out", help="The folder to write (new or empty).")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, choices=("fp8", "tpu_int8", "gguf"))
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--trust-remote-code", action="store_true")


def main(args: argparse.Namespace) -> None:
    convert(
        args.model,
        args.out,
        args.dtype,
        args.quantization,
        args.tensor_parallel_size,
        args.trust_remote_code,
    )
