"""The static metadata ops: upstream's values up to their fixed capacity, fill rules, sync-free asserts, errors."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.datasets import packing as upstream

import packfn

from tests.assertions import assert_same
from tests.strategies import EXAMPLE, INCONSISTENT, fits_dtype, packing_masks

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------- deliberate differences


@pytest.mark.parametrize("name", ["id_reappears_after_another", "ids_out_of_order", "negative_id"])
@pytest.mark.parametrize("function", [packfn.varlen_metadata, packfn.batch_metadata])
def test_static_ops_assert_on_inconsistent_masks(name, function):
    mask, message = INCONSISTENT[name]
    with pytest.raises(RuntimeError, match=message):
        function(mask)


@pytest.mark.parametrize("function", [packfn.varlen_metadata, packfn.batch_metadata])
def test_static_ops_assert_when_a_row_exceeds_max_documents(function):
    with pytest.raises(RuntimeError, match=re.escape("more documents than max_documents=1")):
        function(EXAMPLE, max_documents=1)


@pytest.mark.parametrize("function", [packfn.varlen_metadata, packfn.batch_metadata])
@pytest.mark.parametrize(
    ("mask", "keywords", "error", "message"),
    [
        (torch.ones(4, dtype=torch.int64), {}, ValueError, "shape"),
        (torch.ones(2, 0, dtype=torch.int64), {}, ValueError, "empty"),
        (torch.ones(2, 2), {}, ValueError, "integer or bool"),
        (EXAMPLE, {"max_documents": 0}, ValueError, "positive"),
        (EXAMPLE, {"max_documents": 2.0}, TypeError, "int"),
        ([[1, 0]], {}, TypeError, "torch.Tensor"),
    ],
    ids=["rank_one", "empty", "floating", "zero_capacity", "float_capacity", "list"],
)
def test_static_ops_reject_bad_arguments(function, mask, keywords, error, message):
    with pytest.raises(error, match=message):
        function(mask, **keywords)


@pytest.mark.parametrize(
    ("indices", "bounds", "message"),
    [
        (EXAMPLE.clone(), torch.tensor([[1, 2, 5], [0, 4, -1]]), "start at zero"),
        (torch.tensor([[0, 1, 2, -1]]), torch.tensor([[0, 2, 1, 3]]), "monotonic"),
        (torch.tensor([[0, 1, 2, -1]]), torch.tensor([[0, -1, 3]]), "after a -1"),
        (torch.tensor([[0, 1, 2, -1]]), torch.tensor([[0, 2, 4]]), "last boundary"),
    ],
    ids=["nonzero_start", "not_monotonic", "boundary_after_padding", "wrong_total"],
)
def test_flatten_metadata_asserts_on_malformed_metadata(indices, bounds, message):
    with pytest.raises(RuntimeError, match=message):
        packfn.flatten_metadata(indices, bounds)


def test_flatten_metadata_without_document_slot_raises_value_error_naming_the_shape():
    with pytest.raises(ValueError, match=re.escape("(2, 1)")):
        packfn.flatten_metadata(torch.tensor([[0, -1], [0, 1]]), torch.tensor([[0], [0]], dtype=torch.int32))


@pytest.mark.parametrize("which", ["packed_token_indices", "cu_seqlens"])
def test_flatten_metadata_rejects_bool_metadata(which):
    tensors = {"packed_token_indices": torch.tensor([[0, -1]]), "cu_seqlens": torch.tensor([[0, 1]])}
    tensors[which] = tensors[which] >= 0
    with pytest.raises(ValueError, match=f"{which} must hold integers, got dtype torch.bool"):
        packfn.flatten_metadata(tensors["packed_token_indices"], tensors["cu_seqlens"])


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8])
def test_flatten_metadata_widens_narrow_boundaries_to_int32(dtype):
    # Each row's [0, 100] fits the dtype; the flat total, 200, fits neither int8 nor uint8's 8 bits with room.
    batch = packfn.batch_metadata(torch.ones(2, 100, dtype=torch.int64), max_documents=1)
    flat = packfn.flatten_metadata(batch.packed_token_indices, batch.cu_seqlens.to(dtype))
    assert flat.cu_seqlens.dtype == torch.int32
    assert flat.cu_seqlens.tolist() == [0, 100, 200] and flat.seqlens.tolist() == [100, 100]


# ------------------------------------------------------------ static fills


@SETTINGS
@given(packing_masks(), st.integers(0, 3))
def test_varlen_metadata_prefix_matches_upstream_and_tail_repeats_total(mask, extra_capacity):
    assume(fits_dtype(mask) and mask.any())
    indices, cu_seqlens, max_seqlen = upstream.get_unpad_data(mask)
    documents, tokens = cu_seqlens.numel() - 1, indices.numel()
    batch, sequence = mask.shape
    per_row = max(1, max(len(upstream.get_unpad_data(row[None])[1]) - 1 if row.any() else 0 for row in mask))
    capacity = per_row + extra_capacity
    result = packfn.varlen_metadata(mask, max_documents=capacity)
    assert result.cu_seqlens.shape == (batch * capacity + 1,) and result.cu_seqlens.dtype == torch.int32
    assert torch.equal(result.cu_seqlens[: documents + 1], cu_seqlens)
    assert (result.cu_seqlens[documents + 1 :] == tokens).all()
    assert torch.equal(result.seqlens[:documents], (cu_seqlens[1:] - cu_seqlens[:-1]))
    assert (result.seqlens[documents:] == 0).all()
    assert torch.equal(result.indices[:tokens], indices)
    padding = (~mask.bool()).flatten().nonzero().flatten()
    assert torch.equal(result.indices[tokens:], padding)
    assert result.max_seqlen.item() == max_seqlen and result.max_seqlen.shape == ()
    assert result.num_tokens.item() == tokens and result.num_documents.item() == documents
    assert result.max_seqlen_bound == sequence


@SETTINGS
@given(packing_masks())
def test_batch_metadata_matches_upstream_up_to_its_width(mask):
    assume(fits_dtype(mask) and mask.any())
    expected = upstream.build_packed_sequence_metadata(mask)
    result = packfn.batch_metadata(mask)
    width = expected["cu_seqlens"].shape[1]
    assert result.cu_seqlens.shape == (mask.shape[0], mask.shape[1] + 1)
    common = min(width, result.cu_seqlens.shape[1])
    assert torch.equal(result.cu_seqlens[:, :common], expected["cu_seqlens"][:, :common])
    assert (result.cu_seqlens[:, common:] == -1).all()
    assert torch.equal(result.packed_token_indices, expected["packed_token_indices"])
    assert result.max_seqlen.item() == expected["max_seqlen"]
    assert torch.equal(result.num_documents, ((result.cu_seqlens >= 0).sum(1) - 1))


@SETTINGS
@given(packing_masks())
def test_flatten_metadata_equals_varlen_metadata(mask):
    assume(fits_dtype(mask))
    batch = packfn.batch_metadata(mask)
    flat = packfn.flatten_metadata(batch.packed_token_indices, batch.cu_seqlens)
    direct = packfn.varlen_metadata(mask)
    for field in ("indices", "cu_seqlens", "seqlens", "max_seqlen", "num_tokens", "num_documents"):
        assert torch.equal(getattr(flat, field), getattr(direct, field)), field


@pytest.mark.parametrize("op", ["varlen_metadata", "batch_metadata"])
def test_static_ops_accept_non_contiguous_masks(op):
    mask = torch.tensor([[1, 1, 0], [2, 1, 0], [2, 1, 1], [0, 1, 2]]).t()  # [3, 4], not contiguous
    assert not mask.is_contiguous()
    function = getattr(packfn, op)
    assert_same(tuple(function(mask, max_documents=3)), tuple(function(mask.contiguous(), max_documents=3)))


def test_documented_example():
    flat = packfn.varlen_metadata(EXAMPLE, max_documents=2)
    assert flat.cu_seqlens.tolist() == [0, 2, 5, 9, 9]
    assert flat.seqlens.tolist() == [2, 3, 4, 0]
    assert flat.indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 5, 10, 11]
    assert packfn.batch_metadata(EXAMPLE, max_documents=2).cu_seqlens.tolist() == [[0, 2, 5], [0, 4, -1]]
