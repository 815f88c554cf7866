"""Session fixtures: the embedded tokenizer saved as a directory, tiny models, engines."""

from __future__ import annotations

import os

# Eight fake CPU devices for the tensor-parallel tests; set before JAX starts. Everything
# else runs on the first device, as on a one-device machine.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

# Under pytest-xdist each process keeps its own XLA compilation cache: JAX writes an entry
# in place, and a process reading one that another is still writing fails to load it.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _root = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_root, "jllm", f"xla-{_WORKER}")
    os.makedirs(os.environ["JAX_COMPILATION_CACHE_DIR"], exist_ok=True)

# Requests may ask for at most 8 sequences here (vLLM's limit, read at import): the contract
# fuzzing then sends only requests the 2-core machine serves in seconds.
os.environ.setdefault("VLLM_MAX_N_SEQUENCES", "8")

import pytest  # noqa: E402
from oracle import ARCHS, SMALL, save_copier, save_tiny  # noqa: E402

from jllm.model_loader import resolve_model  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """After each test module, drop the compiled programs of the engines it made. Each
    executable XLA's CPU backend loads keeps memory mappings, and one process running the
    whole suite otherwise reached 61520 of the kernel's limit of 65530 (vm.max_map_count;
    17525 at most with this): past it compiling fails with "LLVM compilation error: Cannot
    allocate memory".

    What survives a module then lives on (imported modules, session fixtures), so it is
    frozen out of the collector's reach: a full collection of this process's heap (torch,
    transformers, JAX) took about 0.4 s, after each of some 150 modules, and the automatic
    ones walked it as well. Objects made later are collected as before."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """A Hugging Face tokenizer directory made offline from the embedded GGUF's tokenizer
    (the one fixture for every test; no skip: `make test` installs the model)."""
    saved = os.environ.get("JLLM_TEST_TOKENIZER_DIR")  # the GPU run's copy (benchmarks/gpu)
    if saved:
        return saved
    path = str(tmp_path_factory.mktemp("smollm2-tokenizer"))
    resolve_model(None).load_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny(arch, root, tokenizer_dir) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def copier_dir(llama_dir, tmp_path_factory) -> str:
    """A tiny Llama that mostly repeats its last token (oracle.save_copier)."""
    return save_copier(llama_dir, tmp_path_factory.mktemp("copier"))


@pytest.fixture(scope="session")
def llama_llm(llama_dir):
    from jllm import LLM

    return LLM(llama_dir, **SMALL)


@pytest.fixture(scope="session")
def all_logprobs_llm(llama_dir):
    """An engine that may return the whole vocabulary's logprobs (max_logprobs=-1)."""
    from jllm import LLM

    return LLM(llama_dir, max_logprobs=-1, **SMALL)


THINKER_SCRIPT = "<think>Let me see.</think>The answer is four"


@pytest.fixture(scope="session")
def thinker_dir(llama_dir, tmp_path_factory) -> str:
    """A tiny Llama with `<think>` tags in its vocabulary that answers every chat prompt with
    THINKER_SCRIPT (scripted_model.save_scripted): a reasoning model for the API tests."""
    from scripted_model import save_scripted

    path = tmp_path_factory.mktemp("thinker")
    return save_scripted(llama_dir, path, THINKER_SCRIPT, added=("<think>", "</think>"))


@pytest.fixture(scope="session")
def st_model(llama_dir, tmp_path_factory):
    """(folder, SentenceTransformer): a sentence-transformers embedding model over the tiny
    Llama (pooling_oracle.save_st_model)."""
    from pooling_oracle import save_st_model

    return save_st_model(llama_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def classifier_dir(llama_dir, tmp_path_factory) -> str:
    """LlamaForSequenceClassification with three labels."""
    from pooling_oracle import save_classifier

    return save_classifier(llama_dir, tmp_path_factory.mktemp("classifier"), 3)


@pytest.fixture(scope="session")
def cross_encoder_dir(llama_dir, tmp_path_factory) -> str:
    """LlamaForSequenceClassification with one label: a cross-encoder that scores pairs."""
    from pooling_oracle import save_classifier

    return save_classifier(llama_dir, tmp_path_factory.mktemp("cross-encoder"), 1)


SLOW_TEST_SECONDS = 60.0


def pytest_runtest_logreport(report):
    """A test phase slower than a minute is named in the log as it ends (`--durations`
    prints only when the whole run finishes, which a CI limit may cut short)."""
    if report.duration > SLOW_TEST_SECONDS and not _WORKER:  # xdist: the controller's line
        import sys

        sys.stderr.write(f"\n[slow] {report.nodeid} {report.when}: {report.duration:.0f} s\n")
