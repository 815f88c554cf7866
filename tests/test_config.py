"""The config package sits below the engine's other packages: it imports nothing from them,
so any of them can import it (jllm/config/)."""

import ast
import pathlib

import pytest

from jllm.config import EngineArgs

CONFIG = pathlib.Path(__file__).resolve().parent.parent / "jllm" / "config"


def test_config_imports_nothing_from_above():
    for path in CONFIG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name == "jllm" or name.startswith("jllm."):
                    assert name.startswith("jllm.config"), f"{path.name} imports {name}"


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
