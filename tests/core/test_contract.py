"""packed_attention_inputs: per contract, the collater's keys with static shapes (its values up to them)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.datasets.packing import _DefaultPackedSequenceContract
from torch.export import Dim

import packfn
import packfn.nemo_automodel as drop_ins

from tests.assertions import assert_same
from tests.compiling import Fn, export_dynamic
from tests.strategies import EXAMPLE, document_mask, documents_per_row
from tests.strategies_attention import packed_batches

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONTRACTS = [
    _DefaultPackedSequenceContract(mask_type, required)
    for mask_type in ("block_causal", "document_ids", "flash_varlen")
    for required in (False, True)
]


@SETTINGS
@given(packed_batches(max_batch=4, max_sequence=32), st.sampled_from(CONTRACTS), st.data())
@example(torch.tensor([[0]]), _DefaultPackedSequenceContract("block_causal", True), None).via("the CI flake of issue 8")
def test_packed_attention_inputs_static_keeps_shapes(mask, contract, data):
    """The static form against the collater's exact values (the drop-in, itself held to the collater)."""
    # The cap a packer guarantees: at least the documents of the fullest row (a
    # smaller one is a broken rule, asserted elsewhere), or the default.
    if data is None:
        max_documents = None
    else:
        max_documents = data.draw(st.sampled_from([None, max(1, documents_per_row(mask)), 12]))
        assume(max_documents is None or max_documents >= documents_per_row(mask))
    ours = packfn.packed_attention_inputs(mask, contract, max_documents=max_documents)
    batch, sequence = mask.shape
    assert ours["_packed_seq_ids"] is mask
    if contract.requires_packed_sequence_metadata and not bool(mask.any()):
        # The collater's metadata needs a valid token; the static form does not.
        with pytest.raises(ValueError, match="at least one valid token"):
            drop_ins.packed_attention_inputs(mask, contract)
        assert ours["cu_seqlens"][:, :2].tolist() == [[0, -1]] * batch
        return
    exact = drop_ins.packed_attention_inputs(mask, contract)
    assert set(ours) == set(exact) | {"_packed_seq_ids"}
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


def test_packed_attention_inputs_errors():
    with pytest.raises(ValueError, match="input_ids must have the shape of document_ids"):
        packfn.packed_attention_inputs(EXAMPLE, input_ids=torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="Unsupported packed_mask_type: 'dense'"):
        packfn.packed_attention_inputs(EXAMPLE, _DefaultPackedSequenceContract("dense"))  # type: ignore[arg-type]


# Issue 8, case 3: attention inputs exported with a dynamic sequence.

_METADATA_VARLEN = _DefaultPackedSequenceContract("flash_varlen", True)


def _attention_inputs(document_ids):
    # document_block_mask is left out: BlockMask.from_kv_blocks (torch) guards on the
    # number of blocks, so it does not export with a Dim on the sequence.
    inputs = packfn.packed_attention_inputs(document_ids, _METADATA_VARLEN, max_documents=16)
    varlen = packfn.physical_varlen_metadata(document_ids)
    return (
        packfn.block_causal_mask(document_ids),
        *varlen[:3],
        inputs["cu_seq_lens_q"],
        inputs["packed_token_indices"],
        inputs["cu_seqlens"],
    )


def test_export_attention_inputs_with_dynamic_sequence_runs_at_other_lengths():
    exported = export_dynamic(
        Fn(_attention_inputs), (document_mask(2, 64, seed=0),), ({1: Dim("S", min=16, max=4096)},)
    )
    for sequence in (40, 300):
        mask = document_mask(2, sequence, seed=sequence)
        assert_same(tuple(exported(mask)), _attention_inputs(mask))
