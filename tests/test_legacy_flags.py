"""The seeds' older vLLM flags, table-driven: each parses on `jllm serve`'s command line and
as an `LLM(...)` keyword, and does what its row says: a value reaches the config, a warning
is logged, or the refusal names the replacement."""

from __future__ import annotations

import logging

import pytest

from jllm.config import EngineArgs
from jllm.config.legacy import LEGACY_FLAGS
from jllm.engine.arg_utils import engine_args_from_namespace
from jllm.entrypoints.openai.cli_args import make_arg_parser


def spec(**fields):
    return lambda a: {k: getattr(a.speculative_config, k) for k in fields} == fields


ROWS = [
    # (command-line flags, keyword arguments, expectation)
    (
        [
            "--speculative-model",
            "[ngram]",
            "--num-speculative-tokens",
            "3",
            "--ngram-prompt-lookup-max",
            "4",
            "--ngram-prompt-lookup-min",
            "2",
        ],
        dict(
            speculative_model="[ngram]",
            num_speculative_tokens=3,
            ngram_prompt_lookup_max=4,
            ngram_prompt_lookup_min=2,
        ),
        (
            "config",
            spec(
                method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2
            ),
            "--speculative-config",
        ),
    ),
    (
        [
            "--speculative-model",
            "[ngram]",
            "--num-speculative-tokens",
            "2",
            "--ngram-prompt-lookup-max",
            "3",
            "--speculative-disable-by-batch-size",
            "8",
            "--speculative-draft-tensor-parallel-size",
            "1",
        ],
        dict(
            speculative_model="[ngram]",
            num_speculative_tokens=2,
            ngram_prompt_lookup_max=3,
            speculative_disable_by_batch_size=8,
            speculative_draft_tensor_parallel_size=1,
        ),
        ("config", spec(disable_by_batch_size=8), "deprecated"),
    ),
    (
        ["--max-context-len-to-capture", "1024"],
        dict(max_context_len_to_capture=1024),
        ("config", lambda a: a.max_seq_len_to_capture == 1024, "--max-seq-len-to-capture"),
    ),
    (["--use-v2-block-manager"], dict(use_v2_block_manager=True), ("warn", None, "ignored")),
    (
        ["--disable-custom-all-reduce"],
        dict(disable_custom_all_reduce=True),
        ("warn", None, "ignored"),
    ),
    (
        ["--max-parallel-loading-workers", "4"],
        dict(max_parallel_loading_workers=4),
        ("warn", None, "ignored"),
    ),
    (
        ["--preemption-mode", "recompute"],
        dict(preemption_mode="recompute"),
        ("warn", None, "ignored"),
    ),
    (
        ["--distributed-executor-backend", "mp"],
        dict(distributed_executor_backend="mp"),
        ("warn", None, "ignored"),
    ),
    (
        ["--preemption-mode", "swap"],
        dict(preemption_mode="swap"),
        ("refuse", None, "--kv-offloading-size"),
    ),
    (
        ["--distributed-executor-backend", "ray"],
        dict(distributed_executor_backend="ray"),
        ("refuse", None, "--nnodes"),
    ),
    (["--engine-use-ray"], dict(engine_use_ray=True), ("refuse", None, "--nnodes")),
    (["--worker-use-ray"], dict(worker_use_ray=True), ("refuse", None, "--nnodes")),
    (["--ray-workers-use-nsight"], dict(ray_workers_use_nsight=True), ("refuse", None, "profiler")),
    (
        ["--tokenizer-pool-size", "4"],
        dict(tokenizer_pool_size=4),
        ("refuse", None, "tokenizer pool"),
    ),
    (
        ["--tokenizer-pool-type", "ray"],
        dict(tokenizer_pool_type="ray"),
        ("refuse", None, "tokenizer pool"),
    ),
    (
        ["--tokenizer-pool-extra-config", "{}"],
        dict(tokenizer_pool_extra_config="{}"),
        ("refuse", None, "tokenizer pool"),
    ),
    (
        ["--max-paddings", "256"],
        dict(max_paddings=256),
        ("refuse", None, "--max-num-batched-tokens"),
    ),
    (["--code-revision", "main"], dict(code_revision="main"), ("refuse", None, "--revision")),
    (
        ["--scheduler-delay-factor", "0.5"],
        dict(scheduler_delay_factor=0.5),
        ("refuse", None, "--max-num-batched-tokens"),
    ),
    (
        ["--speculative-max-model-len", "512"],
        dict(speculative_max_model_len=512),
        ("refuse", None, "--max-model-len"),
    ),
    (
        ["--swap-space", "1"],
        dict(swap_space=1.0),
        ("config", lambda a: a.kv_offloading_size == 1.0, "--kv-offloading-size"),
    ),
    (
        ["--image-input-type", "pixel_values"],
        dict(image_input_type="pixel_values"),
        ("refuse", None, "removed from vLLM"),
    ),
    (
        ["--image-processor", "llava-hf/llava-1.5-7b-hf"],
        dict(image_processor="llava-hf/llava-1.5-7b-hf"),
        ("refuse", None, "--mm-processor-kwargs"),
    ),
    (
        ["--image-processor-revision", "main"],
        dict(image_processor_revision="main"),
        ("refuse", None, "--revision"),
    ),
    (
        ["--disable-image-processor"],
        dict(disable_image_processor=True),
        ("refuse", None, "always go through the model's processor"),
    ),
    (
        ["--long-lora-scaling-factors", "4.0,8.0"],
        dict(long_lora_scaling_factors=(4.0, 8.0)),
        ("refuse", None, "LongLoRA"),
    ),
    (
        ["--lora-extra-vocab-size", "256"],
        dict(lora_extra_vocab_size=256),
        ("warn", None, "--lora-extra-vocab-size is ignored"),
    ),
    (
        ["--qlora-adapter-name-or-path", "adapters/qlora"],
        dict(qlora_adapter_name_or_path="adapters/qlora"),
        ("refuse", None, "--lora-modules"),
    ),
    (
        ["--model-loader-extra-config", '{"n": 1}'],
        dict(model_loader_extra_config='{"n": 1}'),
        ("refuse", None, "no extra configuration"),
    ),
    (
        ["--rope-theta", "20000"],
        dict(rope_theta=20000.0),
        ("config", lambda a: a.hf_overrides == {"rope_theta": 20000.0}, "--hf-overrides"),
    ),
    (
        ["--rope-scaling", '{"rope_type": "linear", "factor": 2.0}'],
        dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
        ("config", lambda a: a.hf_overrides["rope_scaling"]["factor"] == 2.0, "--hf-overrides"),
    ),
    (
        ["--disable-sliding-window"],
        dict(disable_sliding_window=True),
        ("config", lambda a: a.disable_sliding_window, ""),
    ),
    (  # read at load time (tests/test_kv_scales.py)
        ["--quantization-param-path", "kv_scales.json"],
        dict(quantization_param_path="kv_scales.json"),
        ("config", lambda a: a.quantization_param_path == "kv_scales.json", ""),
    ),
    (  # one span per request (tests/test_tracing.py)
        ["--otlp-traces-endpoint", "localhost:4317", "--collect-detailed-traces", "model,worker"],
        dict(otlp_traces_endpoint="localhost:4317", collect_detailed_traces="model,worker"),
        (
            "config",
            lambda a: (
                a.otlp_traces_endpoint == "localhost:4317"
                and a.collect_detailed_traces == ["model", "worker"]
            ),
            "",
        ),
    ),
]


def parse_cli(argv):
    return engine_args_from_namespace(make_arg_parser().parse_args(["--model", "m", *argv]))


@pytest.mark.parametrize("argv, kwargs, expect", ROWS, ids=[" ".join(r[0][:1]) for r in ROWS])
@pytest.mark.parametrize("where", ["cli", "offline"])
def test_legacy_flag(argv, kwargs, expect, where, caplog):
    kind, check, text = expect

    def build():
        return parse_cli(argv) if where == "cli" else EngineArgs.from_kwargs(model="m", **kwargs)

    if kind == "refuse":
        with pytest.raises(ValueError, match=text):
            build()
        return
    with caplog.at_level(logging.WARNING, logger="jllm"):
        args = build()
    if kind == "config":
        assert check(args)
    assert text in caplog.text


def test_every_legacy_flag_is_in_the_help_and_the_table():
    help_text = make_arg_parser().format_help()
    tested = {a.split("=")[0] for row in ROWS for a in row[0] if a.startswith("--")}
    for name in LEGACY_FLAGS:
        flag = "--" + name.replace("_", "-")
        assert flag in help_text
        assert flag in tested, f"{flag} has no row"


def test_legacy_and_new_speculative_flags_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        EngineArgs.from_kwargs(
            model="m",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            num_speculative_tokens=3,
        )
