"""The metadata drop-ins against nemo_automodel 0.7.0: values, types, errors, and their exact CPU paths."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.datasets import packing as upstream
from nemo_automodel.components.models.common import packing as upstream_models

import packfn.nemo_automodel as drop_ins
from packfn._ops import varlen as varlen_ops
from packfn._ops._cpu import numpy_views
from packfn.nemo_automodel._exact import nonzero

from tests.assertions import assert_same, assert_same_outcome, outcome
from tests.strategies import EXAMPLE, INCONSISTENT, fits_dtype, packing_masks

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def static_path_on_cpu():
    """A context in which the drop-ins take the static path on the CPU too (NOTE [Exact sizes on the CPU])."""
    return mock.patch("packfn.nemo_automodel.metadata.exact_on_cpu", lambda *tensors: False)


def without_numpy():
    """A context in which packfn finds no NumPy (the bridge of packfn/_ops/_cpu.py returns None)."""
    return mock.patch("packfn._ops._cpu.numpy", None)


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
    "dropin", [drop_ins.get_unpad_data, drop_ins.get_seqlens_in_batch, drop_ins.build_packed_sequence_metadata]
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
def test_exact_nonzero_is_torch_nonzero(with_numpy, flags):
    """The exact CPU paths' ``nonzero`` (NumPy's where installed) gives aten's positions, as int64."""
    tensor = torch.tensor(flags, dtype=torch.bool)
    with contextlib.nullcontext() if with_numpy else without_numpy():
        positions = nonzero(tensor)
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
    with contextlib.nullcontext() if with_numpy else without_numpy():
        ours = drop_ins.flatten_packed_sequence_metadata(*arguments, **keywords)
    assert_same(ours, expected)
    for tensor in (*arguments, *ours):  # NumPy pinned no storage
        tensor.resize_(tensor.numel() + 1)


@SETTINGS
@given(packing_masks())
def test_get_unpad_data_matches_upstream(mask):
    assume(fits_dtype(mask))
    before = mask.clone()
    assert_same_outcome(outcome(drop_ins.get_unpad_data, mask), outcome(upstream.get_unpad_data, mask))
    assert torch.equal(mask, before)


@SETTINGS
@given(packing_masks())
def test_build_packed_sequence_metadata_matches_upstream(mask):
    assume(fits_dtype(mask))
    before = mask.clone()
    ours = outcome(drop_ins.build_packed_sequence_metadata, mask)
    assert_same_outcome(ours, outcome(upstream.build_packed_sequence_metadata, mask))
    assert torch.equal(mask, before)


@SETTINGS
@given(packing_masks(dtypes=(torch.uint8, torch.int32, torch.int64)))
def test_get_seqlens_in_batch_matches_upstream(mask):
    assume(fits_dtype(mask))
    assert_same(drop_ins.get_seqlens_in_batch(mask), upstream.get_seqlens_in_batch(mask))


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
        ours = drop_ins.flatten_packed_sequence_metadata(*arguments, **keywords)
    assert_same(ours, upstream_models.flatten_packed_sequence_metadata(*arguments, **keywords))
    # The flat result agrees with get_unpad_data's stream.
    indices, cu_seqlens, _ = upstream.get_unpad_data(mask)
    assert torch.equal(ours[0], indices) and torch.equal(ours[1], cu_seqlens)


@pytest.mark.parametrize("exact", [True, False], ids=["exact_cpu_path", "static_path"])
@pytest.mark.parametrize(("dtype", "tokens"), [(torch.int8, 64), (torch.uint8, 128), (torch.int16, 16384)])
def test_flatten_refuses_a_flat_total_the_boundaries_dtype_would_wrap(exact, dtype, tokens):
    """Two rows whose total is one past the dtype's maximum: upstream wraps the last boundary; packfn names it."""
    indices = torch.arange(tokens).repeat(2, 1)
    indices[1, -1] = -1  # one padding token: the total is 2 * tokens - 1, the dtype's maximum
    keywords = {"batch_size": 2, "sequence_length": tokens}
    fits = torch.tensor([[0, tokens], [0, tokens - 1]], dtype=dtype)
    with contextlib.nullcontext() if exact else static_path_on_cpu():
        ours = drop_ins.flatten_packed_sequence_metadata(indices, fits, **keywords)
    assert_same(ours, upstream_models.flatten_packed_sequence_metadata(indices, fits, **keywords))
    indices[1, -1] = tokens - 1
    past = torch.tensor([[0, tokens], [0, tokens]], dtype=dtype)
    wrapped = upstream_models.flatten_packed_sequence_metadata(indices, past, **keywords)[1]
    assert int(wrapped[-1]) != 2 * tokens
    with (
        contextlib.nullcontext() if exact else static_path_on_cpu(),
        pytest.raises(ValueError, match=f"the flat total of the valid tokens is past {2 * tokens - 1}"),
    ):
        drop_ins.flatten_packed_sequence_metadata(indices, past, **keywords)


@SETTINGS
@given(packing_masks(max_batch=3, max_sequence=12))
def test_flatten_packed_sequence_metadata_accepts_flat_metadata(mask):
    assume(fits_dtype(mask) and mask.any())
    indices, cu_seqlens, _ = upstream.get_unpad_data(mask)
    keywords = {"batch_size": mask.shape[0], "sequence_length": mask.shape[1]}
    ours = outcome(drop_ins.flatten_packed_sequence_metadata, indices.int(), cu_seqlens, **keywords)
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
        ours = outcome(drop_ins.flatten_packed_sequence_metadata, indices, bounds, **keywords)
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
        ours = outcome(drop_ins.flatten_packed_sequence_metadata, indices, bounds.int(), **keywords)
    theirs = outcome(upstream_models.flatten_packed_sequence_metadata, indices, bounds.int(), **keywords)
    assert theirs[0] == "error"
    assert_same_outcome(ours, theirs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-1, 6), min_size=0, max_size=5), st.integers(0, 6))
def test_flatten_packed_sequence_metadata_flat_errors_match_upstream(bounds, tokens):
    indices = torch.arange(tokens)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    keywords = {"batch_size": 1, "sequence_length": 8}
    ours = outcome(drop_ins.flatten_packed_sequence_metadata, indices, cu_seqlens, **keywords)
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
    assert_same(drop_ins.get_unpad_data(mask), upstream.get_unpad_data(mask))
    assert_same(drop_ins.build_packed_sequence_metadata(mask), upstream.build_packed_sequence_metadata(mask))
    if mask.dtype != torch.bool:
        assert_same(drop_ins.get_seqlens_in_batch(mask), upstream.get_seqlens_in_batch(mask))


def test_get_seqlens_in_batch_keeps_all_padding_empty():
    mask = torch.zeros(2, 4, dtype=torch.int32)
    assert_same(drop_ins.get_seqlens_in_batch(mask), upstream.get_seqlens_in_batch(mask))


@pytest.mark.parametrize("function", [drop_ins.get_unpad_data, drop_ins.build_packed_sequence_metadata])
@pytest.mark.parametrize(
    "mask",
    [torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.bool)],
    ids=["all_padding", "no_columns", "no_rows"],
)
def test_no_valid_token_message_matches_upstream(function, mask):
    upstream_function = getattr(upstream, function.__name__)
    assert_same_outcome(outcome(function, mask), outcome(upstream_function, mask))


@pytest.mark.parametrize("function", [drop_ins.get_unpad_data, drop_ins.build_packed_sequence_metadata])
@pytest.mark.parametrize("shape", [(6,), (1, 2, 3)])
def test_wrong_rank_message_matches_upstream(function, shape):
    mask = torch.ones(shape, dtype=torch.int64)
    ours, theirs = outcome(function, mask), outcome(getattr(upstream, function.__name__), mask)
    assert_same_outcome(ours, theirs)
    assert "shape" in ours[2]


# ---------------------------------------------------- deliberate differences

DROP_INS = [drop_ins.get_unpad_data, drop_ins.build_packed_sequence_metadata, drop_ins.get_seqlens_in_batch]


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
        drop_ins.get_seqlens_in_batch(EXAMPLE > 0)


def test_get_seqlens_in_batch_rejects_lengths_that_overflow_the_dtype():
    mask = torch.ones(1, 300, dtype=torch.uint8)
    mask[0, -1] = 2  # more than one document: upstream's counting path, which wraps 299 to 43
    assert upstream.get_seqlens_in_batch(mask).tolist() == [299 % 256, 1]
    with pytest.raises(ValueError, match="does not fit"):
        drop_ins.get_seqlens_in_batch(mask)


def test_documented_example():
    indices, cu_seqlens, max_seqlen = drop_ins.get_unpad_data(EXAMPLE)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9] and cu_seqlens.tolist() == [0, 2, 5, 9]
    assert max_seqlen == 4 and type(max_seqlen) is int


# ------------------------------------------------------------ exact CPU paths
# (NOTE [Exact sizes on the CPU] in packfn/nemo_automodel/metadata.py)


def test_exact_cpu_path_follows_the_masks_device_not_the_default_device():
    mask = torch.tensor([[1, 1, 2, 0], [1, 1, 1, 0]])
    expected = drop_ins.build_packed_sequence_metadata(mask)
    with torch.device("meta"):
        got = drop_ins.build_packed_sequence_metadata(mask)
    assert_same(got, expected)


@pytest.mark.parametrize("mask", [[[1, 1, 2, 0, 5], [1, 1, 1, 0, 0]], [[1, 1, 2, 0, 0, 0]]], ids=["batch_2", "batch_1"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact_cpu_path", "static_path"])
def test_build_packed_sequence_metadata_cu_seqlens_is_a_new_tensor_like_upstreams(exact, mask):
    """Contiguous, with upstream's strides, and no larger buffer kept alive behind it (batch one included)."""
    mask = torch.tensor(mask)
    with mock.patch("packfn.nemo_automodel.metadata.exact_on_cpu", lambda *tensors: exact):
        ours = drop_ins.build_packed_sequence_metadata(mask)
    theirs = upstream.build_packed_sequence_metadata(mask)
    assert ours["cu_seqlens"].stride() == theirs["cu_seqlens"].stride()
    assert ours["cu_seqlens"].untyped_storage().nbytes() == ours["cu_seqlens"].nbytes
    assert_same(ours, theirs)


@pytest.mark.parametrize("with_numpy", [True, False])
def test_get_unpad_data_indices_own_resizable_memory(with_numpy):
    """The exact CPU path's positions (NumPy's) come back as a tensor that owns its memory, as aten's."""
    mask = torch.tensor([[1, 1, 0, 2], [0, 3, 3, 0]])
    with contextlib.nullcontext() if with_numpy else without_numpy():
        indices, cu_seqlens, _ = drop_ins.get_unpad_data(mask)
    indices.resize_(16)
    cu_seqlens.resize_(16)


def test_flatten_rejects_decreasing_uint8_boundaries_on_every_path():
    """A decrease of uint8 boundaries wraps when subtracted; the rule compares them instead."""
    indices, bounds = torch.tensor([[0, 1, 2]]), torch.tensor([[0, 5, 3]], dtype=torch.uint8)
    keywords = {"batch_size": 1, "sequence_length": 3}
    with pytest.raises(ValueError) as theirs:
        upstream_models.flatten_packed_sequence_metadata(indices, bounds, **keywords)
    for numpy in (contextlib.nullcontext(), without_numpy()):
        with numpy, pytest.raises(ValueError) as ours:
            drop_ins.flatten_packed_sequence_metadata(indices, bounds, **keywords)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_flatten_of_wide_unsigned_metadata_does_what_upstream_does(dtype):
    """NumPy takes uint16 and wider, aten's ops of the other paths (and upstream's) do not: all paths agree."""
    indices, bounds = torch.tensor([[0, 1, 2, 3]]).to(dtype), torch.tensor([[0, 1, 4]])
    keywords = {"batch_size": 1, "sequence_length": 4}
    theirs = outcome(upstream_models.flatten_packed_sequence_metadata, indices, bounds, **keywords)
    for numpy in (contextlib.nullcontext(), without_numpy()):
        with numpy:
            ours = outcome(drop_ins.flatten_packed_sequence_metadata, indices, bounds, **keywords)
        assert ours[0] == theirs[0] == "error" and ours[1] is theirs[1]


def test_cpu_paths_follow_the_inputs_device_not_the_default_device():
    indices, bounds = torch.tensor([[0, 1, -1], [0, 1, 2]]), torch.tensor([[0, 2, -1], [0, 1, 3]], dtype=torch.int32)
    ids = torch.tensor([[1, 1, 2], [3, 0, 0]])
    keywords = {"batch_size": 2, "sequence_length": 3}

    def both():
        flat = drop_ins.flatten_packed_sequence_metadata(indices, bounds, **keywords)
        return (*flat, *varlen_ops.physical_varlen_metadata_op(ids))

    expected = both()
    with torch.device("meta"):
        got = both()
    assert_same(got, expected)


def test_flatten_error_traceback_holds_no_numpy_view_of_the_inputs():
    """A view in a frame of the traceback would outlive a resize of the input it shows."""
    indices, bounds = torch.tensor([[0, 1]]), torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError) as error:
        drop_ins.flatten_packed_sequence_metadata(indices, bounds, batch_size=1, sequence_length=2)
    frames = [entry.frame.f_locals for entry in error.traceback]
    numpy_type = type(numpy_views(indices)[0])
    assert not any(isinstance(value, numpy_type) for local in frames for value in local.values())


def test_read_only_numpy_views_are_not_written_into():
    """A NumPy whose DLPack imports are read-only (older releases) gets the torch path, with the same result."""
    from packfn._ops import _cpu

    def read_only(tensor):
        view = real_view(tensor)
        if view is not None:
            view.setflags(write=False)
        return view

    real_view = _cpu.numpy_view
    mask = torch.tensor([[1, 1, 2, 0], [1, 1, 1, 0]])
    metadata = drop_ins.build_packed_sequence_metadata(mask)
    tables = (metadata["packed_token_indices"], metadata["cu_seqlens"])
    with mock.patch.object(_cpu, "numpy_view", read_only):
        indices, cu_seqlens = drop_ins.flatten_packed_sequence_metadata(*tables, batch_size=2, sequence_length=4)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6] and cu_seqlens.tolist() == [0, 2, 3, 6]
