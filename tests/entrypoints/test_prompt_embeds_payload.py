"""vLLM's prompt_embeds payload read without torch (jllm/entrypoints/prompt_embeds.py),
against torch.save and safetensors as the writers; payloads that would run code, or read
past their storage, are refused before anything runs."""

from __future__ import annotations

import base64
import io
import os
import pickle
import zipfile

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch

from jllm.entrypoints.prompt_embeds import load_prompt_embeds


def saved(tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_save_payloads(dtype):
    t = torch.randn(5, 8).to(dtype)
    got = load_prompt_embeds(saved(t))
    want = t.float().numpy()
    np.testing.assert_array_equal(got.astype(np.float32), want)
    if dtype == torch.bfloat16:
        assert got.dtype == ml_dtypes.bfloat16


def test_views_and_offsets():
    base = torch.randn(6, 10)
    np.testing.assert_array_equal(load_prompt_embeds(saved(base.t())), base.t().numpy())
    np.testing.assert_array_equal(load_prompt_embeds(saved(base[2:5])), base[2:5].numpy())


def test_safetensors_payload():
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    data = base64.b64encode(safetensors.numpy.save({"embeds": x})).decode()
    np.testing.assert_array_equal(load_prompt_embeds(data), x)


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/jllm-prompt-embeds-pwned",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    marker = "/tmp/jllm-prompt-embeds-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    raw = base64.b64encode(pickle.dumps(Boom())).decode()  # a bare pickle
    with pytest.raises(ValueError, match="could not be deserialized"):
        load_prompt_embeds(raw)
    buf = io.BytesIO()
    torch.save({"x": Boom()}, buf)  # the same inside torch's zip
    with pytest.raises(ValueError, match="posix.system|os.system|not a tensor"):
        load_prompt_embeds(base64.b64encode(buf.getvalue()).decode())
    assert not os.path.exists(marker)


def test_a_tensor_reaching_past_its_storage_is_refused():
    t = torch.randn(2, 3)
    buf = io.BytesIO()
    torch.save(t, buf)
    source, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w") as crafted:  # the pickle says 9 rows of 3: 27 > 6 floats
        for name in source.namelist():
            data = source.read(name)
            if name.endswith("data.pkl"):
                patched = data.replace(b"K\x02K\x03\x86", b"K\x09K\x03\x86", 1)
                assert patched != data
                data = patched
            crafted.writestr(name, data)
    with pytest.raises(ValueError, match="past its storage"):
        load_prompt_embeds(base64.b64encode(out.getvalue()).decode())


@pytest.mark.parametrize(
    "payload, message",
    [
        ("not base64!", "must be base64"),
        (base64.b64encode(b"").decode(), "could not be deserialized"),
        (saved(torch.arange(6).reshape(2, 3)), "could not be deserialized"),  # LongStorage
    ],
)
def test_bad_payloads(payload, message):
    with pytest.raises(ValueError, match=message):
        load_prompt_embeds(payload)
