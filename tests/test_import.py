"""Importing jllm without PyTorch stays quiet: transformers' "PyTorch was not found" notice
is for its model classes, which jllm never uses."""

from __future__ import annotations

import subprocess
import sys

HIDE_TORCH = """
import importlib.util
find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name == "torch" else find(name, *a, **k)
import jllm
import transformers
from jllm.model_loader import resolve_model
assert not transformers.utils.is_torch_available()
"""


def test_no_pytorch_notice_without_torch():
    done = subprocess.run(
        [sys.executable, "-c", HIDE_TORCH], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "PyTorch was not found" not in done.stderr + done.stdout
    # The notice is what transformers prints without jllm's setting.
    bare = HIDE_TORCH.replace("import jllm\n", "").replace(
        "from jllm.model_loader import resolve_model\n", ""
    )
    done = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, timeout=120)
    assert "PyTorch was not found" in done.stderr + done.stdout
