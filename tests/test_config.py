"""Engine arguments: the checks a user's values meet. That the config package sits below the
others (it imports nothing from them, so any of them can import it) is tests/test_imports.py's.
"""

import pytest

from jllm.config import EngineArgs


@pytest.mark.parametrize("value", [0, -2, True, 2.0, "4"])
def test_renderer_num_workers_is_a_positive_int(value):
    with pytest.raises(ValueError, match="renderer_num_workers"):
        EngineArgs(model="m", renderer_num_workers=value)


def test_the_server_flag_sizes_the_processor_pool():
    from jllm.engine.arg_utils import engine_args_from_namespace
    from jllm.entrypoints.openai.cli_args import make_arg_parser

    ns = make_arg_parser().parse_args(["--model", "m", "--renderer-num-workers", "3"])
    assert engine_args_from_namespace(ns).renderer_num_workers == 3
    assert EngineArgs(model="m").renderer_num_workers == 8
