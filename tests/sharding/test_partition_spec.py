"""Logical axes -> mesh axes (sharding/): a dimension its mesh axis does not divide is
replicated only where that is meant (a vocabulary, a broadcast axis, a quantized weight's
scales); any other is an error naming the array, or, unnamed, a warning."""

from __future__ import annotations

import logging

import pytest
from jax.sharding import PartitionSpec as P

from sharding import make_mesh, named_sharding, partition_spec


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(tensor_parallel_size=2, pipeline_parallel_size=2)


@pytest.fixture
def caplog(caplog, monkeypatch):
    """caplog, also once an engine has set up the `jllm` logger (which stops propagating)."""
    monkeypatch.setattr(logging.getLogger("jllm"), "propagate", True)
    return caplog


def test_even_dimensions_split(mesh):
    assert partition_spec(("layers", "embed", "mlp"), (4, 64, 96), mesh) == P(
        "stage", None, "model"
    )


def test_meant_replications(mesh, caplog):
    with caplog.at_level(logging.WARNING, logger="jllm"):
        assert partition_spec(("vocab", "embed"), (49153, 64), mesh, "embed_tokens") == P(
            None, None
        )
        assert partition_spec(("layers", "embed", "mlp"), (4, 64, 1), mesh, "scale") == P(
            "stage", None, None
        )
        spec = partition_spec(("layers", "embed", "mlp"), (4, 64, 3), mesh, "scales", True)
        assert spec == P("stage", None, None)
    assert not caplog.records


def test_an_uneven_weight_is_an_error_naming_it(mesh):
    with pytest.raises(ValueError, match=r"layers\.mlp\.down_proj: its 'mlp' dimension \(size 5"):
        named_sharding(mesh, ("layers", "mlp", "embed"), (4, 5, 64), "layers.mlp.down_proj")
    with pytest.raises(ValueError, match=r"'layers' dimension \(size 3.* 2 devices of .*'stage'"):
        partition_spec(("layers", "embed"), (3, 64), mesh, "layers.norm")


def test_an_unnamed_uneven_array_is_replicated_with_a_warning(mesh, caplog):
    with caplog.at_level(logging.WARNING, logger="jllm"):
        assert partition_spec(("embed", "mlp"), (64, 7), mesh) == P(None, None)
        assert partition_spec(("embed", "mlp"), (64, 7), mesh) == P(None, None)
    assert len(caplog.records) == 1  # once per array form
    assert "'mlp' dimension (size 7, of shape (64, 7))" in caplog.text
