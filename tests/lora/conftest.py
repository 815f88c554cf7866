"""The LoRA tests' adapters, made once per session (lora_oracle.py)."""

from __future__ import annotations

import pytest
from lora_oracle import make_adapters


@pytest.fixture(scope="session")
def adapters(llama_dir, tmp_path_factory):
    """Each adapter's PEFT folder and its merged model's folder (the oracle)."""
    return make_adapters(llama_dir, tmp_path_factory.mktemp("lora"))
