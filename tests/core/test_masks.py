"""Attention masks: the block-causal mask against upstream's collater, BlockMask against create_block_mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.datasets.utils import _indexed_mask_to_4d_block_causal
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import packfn
from packfn._ops import masks as mask_ops

from tests.assertions import assert_same
from tests.references import block_causal_reference, create_reference_block_mask
from tests.strategies import EXAMPLE, packing_masks

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------ block causal


@SETTINGS
@given(packing_masks(max_batch=3, max_sequence=40))
def test_block_causal_mask_matches_upstream_and_reference(mask):
    before = mask.clone()
    ours = packfn.block_causal_mask(mask)
    assert_same(ours, _indexed_mask_to_4d_block_causal(mask))
    assert_same(ours, block_causal_reference(mask))
    assert torch.equal(mask, before)


STATIC_FUNCTIONS = [packfn.block_causal_mask, packfn.physical_varlen_metadata, packfn.document_block_mask]


@pytest.mark.parametrize("function", STATIC_FUNCTIONS)
@pytest.mark.parametrize(
    ("mask", "error", "message"),
    [
        (torch.tensor([1, 1]), ValueError, r"\[batch, sequence\]"),
        (torch.tensor([[0.5, 1.0]]), ValueError, "integer or bool"),
        (torch.zeros(1, 0, dtype=torch.int64), ValueError, "must not be empty"),
        ([[1, 1]], TypeError, "torch.Tensor"),
    ],
)
def test_mask_shape_and_dtype_errors(function, mask, error, message):
    with pytest.raises(error, match=message):
        function(mask)


@pytest.mark.parametrize("function", [packfn.block_causal_mask, packfn.document_block_mask])
@pytest.mark.parametrize(
    ("mask", "message"), [(torch.tensor([[2, 1]]), "must not decrease"), (torch.tensor([[-3, 0]]), "negative")]
)
def test_static_functions_assert_mask_rules_without_sync(function, mask, message):
    # torch._assert_async: a RuntimeError on the CPU, a device assert on a GPU, never a host read.
    with pytest.raises(RuntimeError, match=message):
        function(mask)


@pytest.mark.parametrize(
    "op",
    [
        lambda ids: mask_ops.block_causal_mask_op(ids, True),
        lambda ids: mask_ops.document_block_tables_op(ids, 2, None, True, None, True),
    ],
    ids=["block_causal_mask", "document_block_tables"],
)
def test_ops_report_broken_rules_instead_of_raising(op):
    # One flag per rule of the mask family's table; the third (more documents
    # than the sequence holds) cannot break.
    assert op(torch.tensor([[1, 2, 1, 0]])).broken.tolist() == [False, True, False]
    assert op(torch.tensor([[1, -2, 0, 0]])).broken.tolist() == [True, True, False]  # below the running maximum too
    assert op(EXAMPLE).broken.tolist() == [False, False, False]


# ------------------------------------------------------------ flex attention


BLOCK_FIELDS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)  # fmt: skip


@SETTINGS
@given(
    packing_masks(max_batch=3, max_sequence=48),
    st.sampled_from([1, 2, 3, 4, 7, 16, 128]),
    st.one_of(st.none(), st.integers(1, 20)),
    st.booleans(),
    st.booleans(),
)
@example(torch.tensor([[1, 1, 0, 0, 1, 1]]), 2, 4, True, True).via("full by positions, not by columns")
def test_document_block_mask_equals_create_block_mask(mask, block_size, window, separate, by_position):
    """Also with the window counted in restarting position ids (padding inside documents then counts nothing)."""
    positions = packfn.packed_position_ids(mask) if by_position else None
    ours = packfn.document_block_mask(
        mask, block_size=block_size, window=window, separate_full_blocks=separate, positions=positions
    )
    theirs = create_reference_block_mask(mask, block_size, window, separate, positions)
    for name in BLOCK_FIELDS:
        assert_same(getattr(ours, name), getattr(theirs, name))
    assert_same(ours.to_dense(), theirs.to_dense())
    assert ours.seq_lengths == theirs.seq_lengths and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    sequence = mask.shape[1]
    assert torch.equal(
        create_mask(ours.mask_mod, mask.shape[0], 1, sequence, sequence, "cpu"),
        create_mask(theirs.mask_mod, mask.shape[0], 1, sequence, sequence, "cpu"),
    )


@SETTINGS
@given(packing_masks(max_batch=3, max_sequence=32), st.integers(1, 8))
def test_document_mask_mod_is_block_causal_within_window(mask, window):
    batch, sequence = mask.shape
    dense = create_mask(packfn.document_mask_mod(mask), batch, 1, sequence, sequence, "cpu")
    assert torch.equal(dense, block_causal_reference(mask))
    windowed = create_mask(packfn.document_mask_mod(mask, window=window), batch, 1, sequence, sequence, "cpu")
    positions = torch.arange(sequence)
    near = positions.unsqueeze(1) - positions.unsqueeze(0) < window
    assert torch.equal(windowed, dense & near)
    ranks = packfn.packed_position_ids(mask)
    by_rank = create_mask(
        packfn.document_mask_mod(mask, window=window, positions=ranks), batch, 1, sequence, sequence, "cpu"
    )
    assert torch.equal(by_rank, dense & (ranks.unsqueeze(2) - ranks.unsqueeze(1) < window).unsqueeze(1))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"block_size": 0}, ValueError, "block_size must be positive"),
        ({"window": 0}, ValueError, "window must be positive"),
        ({"window": 2.0}, TypeError, "window must be an int"),
        ({"separate_full_blocks": 1}, TypeError, "separate_full_blocks must be a bool"),
    ],
)
def test_document_block_mask_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        packfn.document_block_mask(EXAMPLE, **kwargs)


# Issue 8, case 6: a block mask sentinel collision.


@pytest.mark.parametrize("ids", [[[5, 5, 0, 0]], [[7, 7, 0, 0, 0, 0]]], ids=["blocks2", "blocks3"])
def test_document_block_mask_equals_create_block_mask_when_an_id_is_blocks_times_block_size_plus_one(ids):
    document_ids = torch.tensor(ids)
    batch, sequence = document_ids.shape
    assert document_ids.max() == -(-sequence // 2) * 2 + 1
    ours = packfn.document_block_mask(document_ids, block_size=2)
    reference = create_block_mask(
        packfn.document_mask_mod(document_ids), batch, 1, sequence, sequence, device="cpu", BLOCK_SIZE=2
    )
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert_same(getattr(ours, field), getattr(reference, field))


@pytest.mark.parametrize(
    "positions",
    [torch.zeros(2, 6), torch.zeros(2, 6, dtype=torch.bool), torch.zeros(2, 6, dtype=torch.uint32),
     torch.zeros(2, 6, dtype=torch.complex64), [[0] * 6] * 2],
    ids=["float", "bool", "uint32", "complex", "list"],
)  # fmt: skip
def test_positions_must_be_a_signed_integer_tensor(positions):
    # Unsigned positions would reach mask_mod, which FlexAttention cannot subtract in (uint32); complex ones lose
    # their imaginary part.
    for function in (packfn.document_block_mask, packfn.document_mask_mod):
        with pytest.raises(TypeError, match="positions must be a signed integer tensor"):
            function(EXAMPLE, window=2, positions=positions)
