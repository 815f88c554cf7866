"""Which checkpoints are pooling models, with which task and head (vLLM's `runner`,
`convert` and `pooler_config` rules), and the head's weights taken out of the checkpoint.

The decoder families serve as pooling models unchanged up to their final norm; the LM head
is never built (the module is tied) and a classifier's `score` projection (or, for
vLLM's `classifier_from_token` recipe, the LM head's rows of the given tokens) is kept on
the host, where the head runs (jllm/pooling/head.py). A sentence-transformers folder
(`modules.json`) gives the pooling type and whether the vector is normalized.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import numpy as np

from jllm.config.pooler import PoolerConfig

logger = logging.getLogger("jllm")

# vLLM's suffix table: a class name's ending -> (runner, convert).
_SUFFIXES = (
    ("ForCausalLM", ("generate", "none")),
    ("ForConditionalGeneration", ("generate", "none")),
    ("ChatModel", ("generate", "none")),
    ("LMHeadModel", ("generate", "none")),
    ("ForSequenceClassification", ("pooling", "classify")),
    ("ClassificationModel", ("pooling", "classify")),
    ("ForTextEncoding", ("pooling", "embed")),
    ("EmbeddingModel", ("pooling", "embed")),
    ("Model", ("pooling", "embed")),
)
# sentence-transformers' pooling modes -> vLLM's pooling types: the `pooling_mode` of its
# Pooling config (version 6), or its older flags.
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "mean_tokens": "MEAN", "cls": "CLS"}
_ST_FLAGS = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


@dataclasses.dataclass(kw_only=True)
class PoolingSpec:
    """A pooling model's task and head. `pooler`: the resolved PoolerConfig (defaults of
    requests); `activation`: a classifier's ("softmax", "sigmoid" or "identity");
    `score`/`score_bias`: its projection [labels, D] (float32, host), set by the loader."""

    task: str  # "embed" or "classify"
    pooler: PoolerConfig
    pooling_type: str  # "LAST", "MEAN" or "CLS" (the prompt's first token)
    embedding_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    num_labels: int = 0
    id2label: dict[int, str] | None = None
    activation: str = "identity"
    # vLLM's classifier_from_token: the LM head's rows of these tokens make the projection
    # ("from_2_way_softmax": yes - no, one label; else one label per token).
    use_sep_token: bool = False  # a cross-encoder's pair: the tokenizer's text pair
    from_tokens: tuple[str, ...] = ()
    method: str = ""
    score: np.ndarray | None = None
    score_bias: np.ndarray | None = None

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return (self.task,)

    @property
    def enable_scoring(self) -> bool:
        """vLLM's rule for /score and /rerank: an embedding model (cosine of the two
        vectors), or a classifier with one label (a cross-encoder)."""
        return self.task == "embed" or self.num_labels == 1


def _st_modules(path: str) -> list[dict] | None:
    modules = os.path.join(path, "modules.json")
    if not os.path.isfile(modules):
        return None
    with open(modules) as f:
        return json.load(f)


def _st_pooling(path: str, modules: list[dict]) -> tuple[str | None, bool]:
    """(the Pooling module's type, whether a Normalize module follows) of a
    sentence-transformers folder; refuses the modules jllm cannot run (Dense projections)."""
    kind, normalize = None, False
    for module in modules:
        name = module.get("type", "").rsplit(".", 1)[-1]  # its class, whatever the version
        if name == "Pooling":
            with open(os.path.join(path, module.get("path", ""), "config.json")) as f:
                config = json.load(f)
            if "pooling_mode" in config:
                modes = [_ST_MODES.get(config["pooling_mode"])]
            else:
                modes = [mode for key, mode in _ST_FLAGS.items() if config.get(key)]
            if len(modes) != 1 or modes[0] is None:
                raise ValueError(
                    f"The sentence-transformers Pooling module of {path} uses a pooling mode "
                    "jllm does not run (lasttoken, mean_tokens or cls_token, one of them)."
                )
            kind = modes[0]
        elif name == "Normalize":
            normalize = True
        elif name not in ("Transformer", ""):
            raise ValueError(
                f"The sentence-transformers module {module.get('type')!r} of {path} is not "
                "supported by jllm yet (a Transformer, a Pooling and a Normalize module are)."
            )
    return kind, normalize


def _defaults(architectures: list[str]) -> tuple[str, str]:
    for name in architectures:
        for suffix, defaults in _SUFFIXES:
            if name.endswith(suffix):
                return defaults
    return "generate", "none"


def _activation(hf, num_labels: int) -> str:
    """vLLM's classifier activation: the config's problem_type, else sigmoid for one label
    and softmax for several."""
    problem = getattr(hf, "problem_type", None)
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    return "sigmoid" if num_labels < 2 else "softmax"


def resolve_pooling(runner: str, convert: str, pooler_config, hf, path: str) -> PoolingSpec | None:
    """The pooling spec of a model (None: a generative model), from the engine arguments
    `runner`, `convert`, `pooler_config`, its transformers config `hf` and its folder."""
    architectures = list(getattr(hf, "architectures", None) or [])
    modules = _st_modules(path) if os.path.isdir(path) else None
    default_runner, default_convert = _defaults(architectures)
    if runner == "auto":
        if convert in ("embed", "classify") or modules is not None:
            runner = "pooling"
        else:
            runner = default_runner
    elif runner == "generate" and default_runner == "pooling":
        raise ValueError(
            "Embedding models do not support `--runner generate`. Use `--runner pooling` or "
            "`--runner auto` for embedding models."
        )
    if runner != "pooling":
        if convert not in ("auto", "none"):
            raise ValueError(f"convert={convert!r} needs runner='pooling'.")
        return None
    if convert in ("auto", "none"):
        convert = default_convert if default_convert != "none" else "embed"
    pooler = dataclasses.replace(pooler_config or PoolerConfig())
    task = pooler.task or convert
    st_type, st_normalize = (None, False) if modules is None else _st_pooling(path, modules)
    if pooler.seq_pooling_type is None:
        pooler.seq_pooling_type = st_type or "LAST"
    if modules is not None and pooler.use_activation is None and task == "embed":
        pooler.use_activation = st_normalize
    hidden = hf.get_text_config().hidden_size
    mds = getattr(hf, "matryoshka_dimensions", None)
    spec = PoolingSpec(
        task=task,
        pooler=pooler,
        pooling_type=pooler.seq_pooling_type,
        embedding_size=int(getattr(hf, "embedding_size", None) or hidden),
        is_matryoshka=bool(mds or getattr(hf, "is_matryoshka", False)),
        matryoshka_dimensions=list(mds) if mds else None,
    )
    if task == "classify":
        tokens = tuple(getattr(hf, "classifier_from_token", None) or ())
        if tokens:
            spec.from_tokens = tokens
            spec.method = getattr(hf, "method", None) or (
                "from_2_way_softmax"
                if getattr(hf, "is_original_qwen3_reranker", False)
                else "no_post_processing"
            )
            if spec.method == "from_2_way_softmax" and len(tokens) != 2:
                raise ValueError("classifier_from_token with from_2_way_softmax names 2 tokens.")
            spec.num_labels = 1 if spec.method == "from_2_way_softmax" else len(tokens)
        else:
            labels = getattr(hf, "id2label", None) or {}
            spec.num_labels = len(labels) or int(getattr(hf, "num_labels", 0) or 0)
            spec.id2label = {int(k): v for k, v in labels.items()} or None
        spec.activation = _activation(hf, spec.num_labels)
        spec.use_sep_token = bool(getattr(hf, "use_sep_token", False))
    logger.info(
        "Pooling model: task %s, %s pooling%s.",
        task,
        spec.pooling_type,
        f", {spec.num_labels} label(s)" if task == "classify" else "",
    )
    return spec


class HeadWeights:
    """A checkpoint source whose weights reach the loader under the decoder's names (a base
    model's `layers.0...` as `model.layers.0...`) without the head's tensors, which it keeps
    for the spec: a classifier's `score.*`, or the LM head's rows of `classifier_from_token`
    (the embeddings' when the head is tied). Everything else is the source's."""

    def __init__(self, source, spec: PoolingSpec, token_ids: list[int]) -> None:
        self._source, self._spec, self._ids = source, spec, token_ids
        self._tied = bool(getattr(source.hf_config, "tie_word_embeddings", False))

    def __getattr__(self, name):
        return getattr(self._source, name)

    def iter_weights(self, keep_quantized: bool = False):
        spec, rows = self._spec, None
        for name, w in self._source.iter_weights(keep_quantized):
            if not name.startswith(("model.", "lm_head.", "score.", "classifier.")):
                name = f"model.{name}"
            if name in ("score.weight", "classifier.weight"):
                spec.score = np.asarray(w, np.float32)
                continue
            if name in ("score.bias", "classifier.bias"):
                spec.score_bias = np.asarray(w, np.float32)
                continue
            head = "model.embed_tokens.weight" if self._tied else "lm_head.weight"
            if spec.from_tokens and name == head:
                rows = np.asarray(w, np.float32)[self._ids]
            if name == "lm_head.weight":
                continue  # never built: the pooling module is tied
            yield name, w
        if spec.from_tokens:
            if rows is None:
                raise ValueError("classifier_from_token: the checkpoint has no LM head rows.")
            spec.score = rows[1:2] - rows[0:1] if spec.method == "from_2_way_softmax" else rows
        check_score(spec)


def check_score(spec: PoolingSpec) -> None:
    if spec.task != "classify":
        return
    if spec.score is None:
        raise ValueError(
            "A classification model needs its `score` projection in the checkpoint (or "
            "hf_overrides' classifier_from_token)."
        )
    if spec.score.ndim != 2 or spec.score.shape[0] != spec.num_labels:
        raise ValueError(
            f"The checkpoint's score projection has shape {tuple(spec.score.shape)}; the "
            f"config has {spec.num_labels} label(s)."
        )


def dummy_head(spec: PoolingSpec, hidden: int, seed: int) -> None:
    """load_format="dummy": a random classifier projection."""
    if spec.task == "classify" and spec.score is None:
        rng = np.random.default_rng(seed)
        spec.score = rng.normal(0, 0.02, (spec.num_labels, hidden)).astype(np.float32)
