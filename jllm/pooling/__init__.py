"""Pooling models (vLLM's `runner="pooling"`): embeddings, classification and scores.

A pooling request runs its prompt through the model like a generation request whose only
"token" is never sampled: at the end of its prefill the runner hands back the final-norm
hidden state of its last prompt token (LAST pooling) instead of running the LM head and
the sampler (runner/model_runner.py), and the front end turns that vector into the
request's output with the model's head (`head.py`: the embedding's cut and normalization,
the classifier's projection and activation). `model.py` decides whether a checkpoint is a
pooling model and with which task, as vLLM's `runner`/`convert` rules do.
"""
