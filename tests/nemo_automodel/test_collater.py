"""The drop-in packed_attention_inputs: neat_packed_collater's packed keys of nemo_automodel 0.7.0, exactly."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.datasets.packing import _DefaultPackedSequenceContract
from nemo_automodel.components.datasets.utils import neat_packed_collater

import packfn.nemo_automodel as drop_ins

from tests.assertions import assert_same, assert_same_outcome, outcome
from tests.compiling import traced
from tests.strategies import EXAMPLE
from tests.strategies_attention import packed_batches

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONTRACTS = [
    _DefaultPackedSequenceContract(mask_type, required)
    for mask_type in ("block_causal", "document_ids", "flash_varlen")
    for required in (False, True)
]


def passthrough(mask):
    """``input_ids``, ``labels``, ``position_ids`` for a packed batch."""
    return {"input_ids": mask * 7, "labels": mask * 5, "position_ids": torch.arange(mask.shape[1]).expand_as(mask)}


def collate(mask, contract):
    tensors = passthrough(mask)
    batch = [{**{name: t[row] for name, t in tensors.items()}, "attention_mask": mask[row]} for row in range(len(mask))]
    return neat_packed_collater(batch, packing=contract)


@SETTINGS
@given(packed_batches(max_batch=4, max_sequence=32, dtypes=(torch.int64,)), st.sampled_from(CONTRACTS))
def test_packed_attention_inputs_exact_matches_collater(mask, contract):
    theirs = outcome(collate, mask, contract)
    ours = outcome(lambda: drop_ins.packed_attention_inputs(mask, contract, **passthrough(mask)))
    assert_same_outcome(ours, theirs)


# Issue 8, case 7: the exact form traced.


@pytest.mark.parametrize("mask_type", ["block_causal", "document_ids", "flash_varlen"])
def test_compiled_exact_attention_inputs_equal_eager_for_metadata_contracts(mask_type):
    contract = _DefaultPackedSequenceContract(mask_type, True)
    compiled = traced(functools.partial(drop_ins.packed_attention_inputs, contract=contract))
    assert_same(compiled(EXAMPLE), drop_ins.packed_attention_inputs(EXAMPLE, contract))


@pytest.mark.parametrize("mask_type", ["block_causal", "document_ids", "flash_varlen"])
def test_compiled_exact_attention_inputs_without_metadata_say_use_static(mask_type):
    contract = _DefaultPackedSequenceContract(mask_type, False)
    compiled = traced(functools.partial(drop_ins.packed_attention_inputs, contract=contract))
    # Under fullgraph Dynamo wraps the ValueError raised while tracing in
    # Unsupported, whose text quotes it.
    with pytest.raises(
        (ValueError, torch._dynamo.exc.Unsupported), match=r"use packfn\.packed_attention_inputs under torch\.compile"
    ):
        compiled(EXAMPLE)
