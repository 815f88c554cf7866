"""Pooling models made from the tiny Llama, with their oracles: a sentence-transformers
embedding model (last-token pooling, normalized), transformers classifiers (three labels,
and one label: a cross-encoder). The session fixtures that hold them are in conftest.py."""

from __future__ import annotations

import json
import shutil

import torch
import transformers


def plain_copy(model_dir: str, path) -> str:
    """The model folder without a chat template: sentence-transformers 6 renders texts
    through a tokenizer's chat template, vLLM (and jllm) embed the text itself."""
    shutil.copytree(model_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return str(path)


def save_st_model(llama_dir: str, tmp_path_factory, mode: str = "lasttoken"):
    """(folder, SentenceTransformer): the tiny Llama with last-token pooling and Normalize,
    saved as sentence-transformers saves it (modules.json, a LlamaModel checkpoint)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    plain = plain_copy(llama_dir, tmp_path_factory.mktemp("st") / "plain")
    body = Transformer(plain)
    pooling = Pooling(body.get_embedding_dimension(), pooling_mode=mode)
    model = SentenceTransformer(modules=[body, pooling, Normalize()], device="cpu")
    path = tmp_path_factory.mktemp("st-embed")
    model.save(str(path))
    return str(path), model


def save_classifier(llama_dir: str, path, num_labels: int) -> str:
    torch.manual_seed(1)
    labels = {i: f"label_{i}" for i in range(num_labels)}
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        llama_dir,
        num_labels=num_labels,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.2)
    model.config.pad_token_id = 0
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(llama_dir).save_pretrained(path)
    return str(path)


def hf_last_logits(
    model_dir: str, ids: list[int], cls=transformers.AutoModelForSequenceClassification
):
    model = cls.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
