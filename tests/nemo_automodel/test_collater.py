"""The drop-in packed_attention_inputs: neat_packed_collater's packed keys of nemo_automodel 0.7.0, exact or static."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.datasets.packing import _DefaultPackedSequenceContract
from nemo_automodel.components.datasets.utils import neat_packed_collater

import packfn
import packfn.nemo_automodel as drop_ins

from tests.assertions import assert_same, assert_same_outcome, outcome
from tests.compiling import traced
from tests.strategies import EXAMPLE, documents_per_row
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
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match=r"static=True\) under torch\.compile"):
        compiled(EXAMPLE)


# The static form: every shape a function of [batch, sequence], the exact values up to them.


@SETTINGS
@given(packed_batches(max_batch=4, max_sequence=32), st.sampled_from(CONTRACTS), st.data())
@example(torch.tensor([[0]]), _DefaultPackedSequenceContract("block_causal", True), None).via("the CI flake of issue 8")
def test_packed_attention_inputs_static_keeps_shapes(mask, contract, data):
    """The static form against the collater's exact values (the exact form, itself held to the collater)."""
    # The cap a packer guarantees: at least the documents of the fullest row (a
    # smaller one is a broken rule, asserted elsewhere), or the default.
    if data is None:
        max_documents = None
    else:
        max_documents = data.draw(st.sampled_from([None, max(1, documents_per_row(mask)), 12]))
        assume(max_documents is None or max_documents >= documents_per_row(mask))
    if not contract.requires_packed_sequence_metadata:
        max_documents = None  # it sizes the metadata only
    ours = drop_ins.packed_attention_inputs(mask, contract, static=True, max_documents=max_documents)
    batch, sequence = mask.shape
    assert ours["_packed_seq_ids"] is mask
    if contract.requires_packed_sequence_metadata and not bool(mask.any()):
        # The collater's metadata needs a valid token; the static form does not.
        with pytest.raises(ValueError, match="at least one valid token"):
            drop_ins.packed_attention_inputs(mask, contract)
        assert ours["cu_seqlens"][:, :2].tolist() == [[0, -1]] * batch
        return
    exact = drop_ins.packed_attention_inputs(mask, contract)
    assert list(ours) == [*[key for key in exact if key != "_packed_seq_ids"], "_packed_seq_ids"]
    if "attention_mask" in exact:
        assert_same(ours["attention_mask"], exact["attention_mask"])
    if "cu_seq_lens_q" in exact:
        assert ours["cu_seq_lens_q"] is ours["cu_seq_lens_k"]
        assert ours["cu_seq_lens_q"].shape == (batch * sequence + 1,)
        segments = exact["cu_seq_lens_q"].numel()
        assert torch.equal(ours["cu_seq_lens_q"][:segments], exact["cu_seq_lens_q"])
        assert ours["max_length_q"] == ours["max_length_k"] == sequence >= exact["max_length_q"]
    if "cu_seqlens" in exact:
        assert ours["cu_seqlens"].shape == (batch, (max_documents or sequence) + 1)
        width = min(exact["cu_seqlens"].shape[1], ours["cu_seqlens"].shape[1])
        assert torch.equal(ours["cu_seqlens"][:, :width], exact["cu_seqlens"][:, :width])
        assert_same(ours["packed_token_indices"], exact["packed_token_indices"])
        assert ours["max_seqlen"] == sequence >= exact["max_seqlen"]


def test_static_inputs_are_the_core_attention_inputs_of_the_mask_type():
    for mask_type in ("block_causal", "document_ids", "flash_varlen"):
        contract = _DefaultPackedSequenceContract(mask_type, False)
        ours = drop_ins.packed_attention_inputs(EXAMPLE, contract, static=True)
        assert_same(
            {key: ours[key] for key in ours if key != "_packed_seq_ids"}, packfn.attention_inputs(EXAMPLE, mask_type)
        )


@pytest.mark.parametrize("contract", CONTRACTS, ids=str)
def test_static_attention_inputs_compile_fullgraph_for_every_contract(contract):
    torch._dynamo.reset()  # one compile per contract: the cache of the shared code object starts empty
    compiled = torch.compile(
        functools.partial(drop_ins.packed_attention_inputs, contract=contract, static=True),
        fullgraph=True,
        backend="aot_eager",
    )
    assert_same(compiled(EXAMPLE), drop_ins.packed_attention_inputs(EXAMPLE, contract, static=True))


# Issue 26: a mask type string where a contract is expected, and other bad arguments.


def test_packed_attention_inputs_refuses_a_mask_type_string_for_the_contract():
    message = "contract must be a PackedSequenceContract .* got str 'flash_varlen'"
    with pytest.raises(TypeError, match=message):
        drop_ins.packed_attention_inputs(EXAMPLE, "flash_varlen")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=message):
        drop_ins.packed_attention_inputs(EXAMPLE, "flash_varlen", static=True)  # type: ignore[arg-type]


def test_packed_attention_inputs_errors():
    with pytest.raises(ValueError, match="input_ids must have the shape of document_ids"):
        drop_ins.packed_attention_inputs(EXAMPLE, input_ids=torch.zeros(2, 5, dtype=torch.int64))
    for static in (False, True):
        with pytest.raises(ValueError, match="Unsupported packed_mask_type: 'sdpa'"):
            drop_ins.packed_attention_inputs(EXAMPLE, _DefaultPackedSequenceContract("sdpa"), static=static)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_documents sizes the static metadata"):
        drop_ins.packed_attention_inputs(EXAMPLE, max_documents=4)
    with pytest.raises(TypeError, match="static must be a bool"):
        drop_ins.packed_attention_inputs(EXAMPLE, static=1)  # type: ignore[arg-type]
