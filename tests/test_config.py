"""The config package sits below the engine's other packages: it imports nothing from them,
so any of them can import it (jllm/config/)."""

import ast
import pathlib

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
