"""Mask parsing: packfn's drop-ins against nemo_automodel 0.7.0, and the static ops' fill rules."""

from __future__ import annotations

import contextlib
import re
from unittest import mock

import pytest
import torch
from assertions import assert_same, outcome
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.datasets import packing as upstream
from nemo_automodel.components.models.common import packing as upstream_models
from strategies import packing_masks

import packfn
from packfn._checks import cpu_nonzero

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXAMPLE = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])


def assert_same_outcome(ours, theirs) -> None:
    assert ours[0] == theirs[0], (ours, theirs)
    if ours[0] == "ok":
        assert_same(ours[1], theirs[1])
    else:
        assert ours[1:] == theirs[1:]


def static_path_on_cpu():
    """A context in which the drop-ins take the static path on the CPU too (NOTE [Exact sizes on the CPU])."""
    return mock.patch("packfn.metadata.exact_on_cpu", lambda *tensors: False)


def fits_dtype(mask: torch.Tensor) -> bool:
    """Whether every document length fits the mask's dtype (upstream wraps silently otherwise)."""
    if mask.dtype == torch.bool:
        return True
    lengths = [(mask == value).sum().item() for value in mask.unique().tolist() if value]
    return max(lengths, default=0) <= torch.iinfo(mask.dtype).max


# ------------------------------------------------------------------ drop-ins


@st.composite
def masks_broken_or_not(draw) -> torch.Tensor:
    """A packing mask, or one with a value changed (negative or decreasing ids, narrow-dtype overflow)."""
    mask = draw(packing_masks(max_batch=4, max_sequence=300))
    if draw(st.booleans()) and mask.dtype != torch.bool:
        flat = mask.reshape(-1).clone()
        position = draw(st.integers(0, flat.numel() - 1))
        low = -3 if mask.dtype.is_signed else 0
        flat[position] = draw(st.integers(low, 3))
        mask = flat.view(mask.shape)
    return mask


@pytest.mark.parametrize(
    "dropin", [packfn.get_unpad_data, packfn.get_seqlens_in_batch, packfn.build_packed_sequence_metadata]
)
@SETTINGS
@given(mask=masks_broken_or_not())
def test_exact_cpu_path_equals_the_static_path(dropin, mask):
    """NOTE [Exact sizes on the CPU]: both eager paths give the same results and the same errors."""
    exact = outcome(dropin, mask)
    with static_path_on_cpu():
        static = outcome(dropin, mask)
    assert_same_outcome(exact, static)


@pytest.mark.parametrize("with_numpy", [True, False])
@SETTINGS
@given(flags=st.lists(st.booleans(), max_size=200))
def test_cpu_nonzero_is_torch_nonzero(with_numpy, flags):
    """The exact CPU paths' ``nonzero`` (NumPy's where installed) gives aten's positions, as int64."""
    tensor = torch.tensor(flags, dtype=torch.bool)
    with contextlib.nullcontext() if with_numpy else mock.patch("packfn._checks.numpy", None):
        positions = cpu_nonzero(tensor)
    assert positions.dtype == torch.int64
    assert torch.equal(positions, tensor.nonzero().squeeze(1))


@pytest.mark.parametrize("with_numpy", [True, False])
@SETTINGS
@given(mask=packing_masks(max_batch=3, max_sequence=40), strided=st.booleans())
def test_flatten_exact_path_on_strided_inputs_and_without_numpy(with_numpy, mask, strided):
    """flatten's exact CPU path (NumPy views; the static path without NumPy) on column-major inputs too.

    The results equal upstream's on the contiguous inputs and own resizable memory.
    """
    assume(fits_dtype(mask) and mask.any())
    metadata = upstream.build_packed_sequence_metadata(mask)
    arguments = (metadata["packed_token_indices"], metadata["cu_seqlens"])
    keywords = {"batch_size": mask.shape[0], "sequence_length": mask.shape[1]}
    expected = upstream_models.flatten_packed_sequence_metadata(*arguments, **keywords)
    if strided:  # the same values, column-major
        arguments = tuple(tensor.t().contiguous().t() for tensor in arguments)
    with contextlib.nullcontext() if with_numpy else mock.patch("packfn._checks.numpy", None):
        ours = packfn.flatten_packed_sequence_metadata(*arguments, **keywords)
    assert_same(ours, expected)
    for tensor in (*arguments, *ours):  # NumPy pinned no storage
        tensor.resize_(tensor.numel() + 1)


@SETTINGS
@given(packing_masks())
def test_get_unpad_data_matches_upstream(mask):
    assume(fits_dtype(mask))
    before = mask.clone()
    assert_same_outcome(outcome(packfn.get_unpad_data, mask), outcome(upstream.get_unpad_data, mask))
    assert torch.equal(mask, before)


@SETTINGS
@given(packing_masks())
def test_build_packed_sequence_metadata_matches_upstream(mask):
    assume(fits_dtype(mask))
    before = mask.clone()
    ours = outcome(packfn.build_packed_sequence_metadata, mask)
    assert_same_outcome(ours, outcome(upstream.build_packed_sequence_metadata, mask))
    assert torch.equal(mask, before)


@SETTINGS
@given(packing_masks(dtypes=(torch.uint8, torch.int32, torch.int64)))
def test_get_seqlens_in_batch_matches_upstream(mask):
    assume(fits_dtype(mask))
    assert_same(packfn.get_seqlens_in_batch(mask), upstream.get_seqlens_in_batch(mask))


@pytest.mark.parametrize("exact", [True, False], ids=["exact_cpu_path", "static_path"])
@SETTINGS
@given(packing_masks())
def test_flatten_packed_sequence_metadata_matches_upstream_on_batch_metadata(exact, mask):
    assume(fits_dtype(mask) and mask.any())
    metadata = upstream.build_packed_sequence_metadata(mask)
    batch, sequence = mask.shape
    arguments = (metadata["packed_token_indices"], metadata["cu_seqlens"])
    keywords = {"batch_size": batch, "sequence_length": sequence}
    with contextlib.nullcontext() if exact else static_path_on_cpu():
        ours = packfn.flatten_packed_sequence_metadata(*arguments, **keywords)
    assert_same(ours, upstream_models.flatten_packed_sequence_metadata(*arguments, **keywords))
    # The flat result agrees with get_unpad_data's stream.
    indices, cu_seqlens, _ = upstream.get_unpad_data(mask)
    assert torch.equal(ours[0], indices) and torch.equal(ours[1], cu_seqlens)


@SETTINGS
@given(packing_masks(max_batch=3, max_sequence=12))
def test_flatten_packed_sequence_metadata_accepts_flat_metadata(mask):
    assume(fits_dtype(mask) and mask.any())
    indices, cu_seqlens, _ = upstream.get_unpad_data(mask)
    keywords = {"batch_size": mask.shape[0], "sequence_length": mask.shape[1]}
    ours = outcome(packfn.flatten_packed_sequence_metadata, indices.int(), cu_seqlens, **keywords)
    theirs = outcome(upstream_models.flatten_packed_sequence_metadata, indices.int(), cu_seqlens, **keywords)
    assert_same_outcome(ours, theirs)


small_ints = st.integers(-2, 6)


@pytest.mark.parametrize("exact", [True, False], ids=["exact_cpu_path", "static_path"])
@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 4),
    st.data(),
)
def test_flatten_packed_sequence_metadata_rejects_what_upstream_rejects(exact, batch, sequence, width, data):
    """Arbitrary (mostly malformed) metadata: the same result or ValueError as upstream, on both eager paths."""
    indices = torch.tensor(
        data.draw(st.lists(st.sampled_from([-1, 0, 1, 2]), min_size=batch * sequence, max_size=batch * sequence))
    ).reshape(batch, sequence)
    bounds = torch.tensor(
        data.draw(st.lists(small_ints, min_size=batch * width, max_size=batch * width)), dtype=torch.int32
    ).reshape(batch, width)
    shape_batch = data.draw(st.sampled_from([batch, batch + 1]))
    keywords = {"batch_size": shape_batch, "sequence_length": sequence}
    with contextlib.nullcontext() if exact else static_path_on_cpu():
        ours = outcome(packfn.flatten_packed_sequence_metadata, indices, bounds, **keywords)
    theirs = outcome(upstream_models.flatten_packed_sequence_metadata, indices, bounds, **keywords)
    assert_same_outcome(ours, theirs)


# Batch-major metadata that breaks one rule of FLATTEN_RULES (or has no
# document), where packfn's other rules hold: (packed_token_indices, cu_seqlens).
BROKEN_BATCH_METADATA = {
    "decreasing": ([[0, 1]], [[0, 3, 2]]),
    "boundary_after_a_gap": ([[0, 1]], [[0, -1, 2, 2]]),
    "first_boundary_not_zero": ([[0, 1]], [[1, 2]]),
    "last_boundary_not_the_row_tokens": ([[0, 1, 2]], [[0, 1, 2]]),
    "no_valid_boundary": ([[0], [-1]], [[0, 1], [-1, -1]]),
    "no_document": ([[-1, -1]], [[0, -1]]),
}


@pytest.mark.parametrize("exact", [True, False], ids=["exact_cpu_path", "static_path"])
@pytest.mark.parametrize("name", BROKEN_BATCH_METADATA)
def test_flatten_packed_sequence_metadata_rejects_each_broken_rule(exact, name):
    indices, bounds = (torch.tensor(rows) for rows in BROKEN_BATCH_METADATA[name])
    keywords = {"batch_size": indices.shape[0], "sequence_length": indices.shape[1]}
    with contextlib.nullcontext() if exact else static_path_on_cpu():
        ours = outcome(packfn.flatten_packed_sequence_metadata, indices, bounds.int(), **keywords)
    theirs = outcome(upstream_models.flatten_packed_sequence_metadata, indices, bounds.int(), **keywords)
    assert theirs[0] == "error"
    assert_same_outcome(ours, theirs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-1, 6), min_size=0, max_size=5), st.integers(0, 6))
def test_flatten_packed_sequence_metadata_flat_errors_match_upstream(bounds, tokens):
    indices = torch.arange(tokens)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    keywords = {"batch_size": 1, "sequence_length": 8}
    ours = outcome(packfn.flatten_packed_sequence_metadata, indices, cu_seqlens, **keywords)
    theirs = outcome(upstream_models.flatten_packed_sequence_metadata, indices, cu_seqlens, **keywords)
    assert_same_outcome(ours, theirs)


EDGE_MASKS = {
    "example": EXAMPLE,
    "one_token_documents": torch.tensor([[1, 2, 3, 4], [1, 0, 2, 0]]),
    "all_padding_row": torch.tensor([[0, 0, 0], [1, 1, 2]]),
    "padding_inside_document": torch.tensor([[1, 1, 0, 1, 2, 0, 2]]),
    "gaps_in_ids": torch.tensor([[2, 2, 5, 9, 9, 0]]),
    "id_larger_than_sequence": torch.tensor([[7]]),
    "padding_first": torch.tensor([[0, 0, 1, 1, 3]]),
    "int32": EXAMPLE.int(),
    "uint8": EXAMPLE.to(torch.uint8),
    "int8": EXAMPLE.to(torch.int8),
    "bool": EXAMPLE > 0,
    "ids_all_one": torch.tensor([[1, 1, 0], [0, 1, 1]]),
    "full_rows": torch.ones(3, 5, dtype=torch.int64),
}


@pytest.mark.parametrize("name", sorted(EDGE_MASKS))
def test_edge_masks_match_upstream(name):
    mask = EDGE_MASKS[name]
    assert_same(packfn.get_unpad_data(mask), upstream.get_unpad_data(mask))
    assert_same(packfn.build_packed_sequence_metadata(mask), upstream.build_packed_sequence_metadata(mask))
    if mask.dtype != torch.bool:
        assert_same(packfn.get_seqlens_in_batch(mask), upstream.get_seqlens_in_batch(mask))


def test_get_seqlens_in_batch_keeps_all_padding_empty():
    mask = torch.zeros(2, 4, dtype=torch.int32)
    assert_same(packfn.get_seqlens_in_batch(mask), upstream.get_seqlens_in_batch(mask))


@pytest.mark.parametrize("function", [packfn.get_unpad_data, packfn.build_packed_sequence_metadata])
@pytest.mark.parametrize(
    "mask",
    [torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.bool)],
    ids=["all_padding", "no_columns", "no_rows"],
)
def test_no_valid_token_message_matches_upstream(function, mask):
    upstream_function = getattr(upstream, function.__name__)
    assert_same_outcome(outcome(function, mask), outcome(upstream_function, mask))


@pytest.mark.parametrize("function", [packfn.get_unpad_data, packfn.build_packed_sequence_metadata])
@pytest.mark.parametrize("shape", [(6,), (1, 2, 3)])
def test_wrong_rank_message_matches_upstream(function, shape):
    mask = torch.ones(shape, dtype=torch.int64)
    ours, theirs = outcome(function, mask), outcome(getattr(upstream, function.__name__), mask)
    assert_same_outcome(ours, theirs)
    assert "shape" in ours[2]


# ---------------------------------------------------- deliberate differences

INCONSISTENT = {
    "id_reappears_after_another": (torch.tensor([[1, 1, 2, 1]]), "must not decrease"),
    "ids_out_of_order": (torch.tensor([[2, 2, 1, 0]]), "must not decrease"),
    "negative_id": (torch.tensor([[1, -1, 0]]), "negative"),
    "floating_mask": (torch.tensor([[1.0, 1.0, 0.0]]), "integer or bool"),
}
DROP_INS = [packfn.get_unpad_data, packfn.build_packed_sequence_metadata, packfn.get_seqlens_in_batch]


@pytest.mark.parametrize("name", sorted(INCONSISTENT))
@pytest.mark.parametrize("function", DROP_INS, ids=lambda function: function.__name__)
def test_drop_ins_reject_masks_upstream_gets_wrong(name, function):
    mask, message = INCONSISTENT[name]
    before = mask.clone()
    with pytest.raises(ValueError, match=message):
        function(mask)
    assert torch.equal(mask, before)


def test_get_seqlens_in_batch_rejects_bool_mask():
    with pytest.raises(ValueError, match="bool mask"):
        packfn.get_seqlens_in_batch(EXAMPLE > 0)


def test_get_seqlens_in_batch_rejects_lengths_that_overflow_the_dtype():
    mask = torch.ones(1, 300, dtype=torch.uint8)
    mask[0, -1] = 2  # more than one document: upstream's counting path, which wraps 299 to 43
    assert upstream.get_seqlens_in_batch(mask).tolist() == [299 % 256, 1]
    with pytest.raises(ValueError, match="does not fit"):
        packfn.get_seqlens_in_batch(mask)


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


# ------------------------------------------------------------ static fills


@SETTINGS
@given(packing_masks(), st.integers(0, 3))
def test_varlen_metadata_prefix_matches_upstream_and_tail_repeats_total(mask, extra_capacity):
    assume(fits_dtype(mask) and mask.any())
    indices, cu_seqlens, max_seqlen = upstream.get_unpad_data(mask)
    documents, tokens = cu_seqlens.numel() - 1, indices.numel()
    batch, sequence = mask.shape
    per_row = max(1, max(len(packfn.get_unpad_data(row[None])[1]) - 1 if row.any() else 0 for row in mask))
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


def test_documented_example():
    flat = packfn.varlen_metadata(EXAMPLE, max_documents=2)
    assert flat.cu_seqlens.tolist() == [0, 2, 5, 9, 9]
    assert flat.seqlens.tolist() == [2, 3, 4, 0]
    assert flat.indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 5, 10, 11]
    assert packfn.batch_metadata(EXAMPLE, max_documents=2).cu_seqlens.tolist() == [[0, 2, 5], [0, 4, -1]]
    indices, cu_seqlens, max_seqlen = packfn.get_unpad_data(EXAMPLE)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9] and cu_seqlens.tolist() == [0, 2, 5, 9]
    assert max_seqlen == 4 and type(max_seqlen) is int
