"""Microbatch splits of batch-major metadata (what a pipeline schedule does to a batch)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import packfn
from packfn.distributed import split_batch_metadata

from tests.assertions import assert_same
from tests.strategies import documents_per_row, packing_masks

SETTINGS = settings(max_examples=30)


@st.composite
def split_cases(draw):
    """A mask, a document cap that fits it (``D`` of the static API) and a microbatch count in ``[1, batch]``."""
    mask = draw(packing_masks(max_batch=8, max_sequence=48))
    capacity = draw(st.integers(max(1, documents_per_row(mask)), mask.shape[1]))
    return mask, capacity, draw(st.integers(1, mask.shape[0]))


@SETTINGS
@given(split_cases())
def test_split_equals_metadata_recomputed_per_microbatch(case):
    mask, capacity, count = case
    splits = split_batch_metadata(packfn.batch_metadata(mask, max_documents=capacity), count)
    microbatches = torch.tensor_split(mask, count)
    assert len(splits) == count
    for split, microbatch in zip(splits, microbatches, strict=True):
        assert_same(split, packfn.batch_metadata(microbatch, max_documents=capacity))


@SETTINGS
@given(split_cases())
def test_flatten_of_each_split_is_the_microbatch_varlen_metadata(case):
    mask, capacity, count = case
    for split, microbatch in zip(
        split_batch_metadata(packfn.batch_metadata(mask, max_documents=capacity), count),
        torch.tensor_split(mask, count),
        strict=True,
    ):
        flat = packfn.flatten_metadata(split.packed_token_indices, split.cu_seqlens)  # asserts its rules
        assert_same(flat, packfn.varlen_metadata(microbatch, max_documents=capacity))


def test_plain_slice_keeps_the_batch_max_seqlen_split_recomputes_it():
    mask = torch.tensor([[1, 1, 1, 1, 2, 0], [1, 1, 2, 2, 0, 0]])
    metadata = packfn.batch_metadata(mask, max_documents=2)
    assert int(metadata.max_seqlen) == 4
    first, second = split_batch_metadata(metadata, 2)
    assert int(first.max_seqlen) == 4
    assert int(second.max_seqlen) == 2  # a slice of the rows alone would still say 4
    assert first.max_seqlen.dtype == torch.int32


def test_split_of_an_all_padding_microbatch_has_max_seqlen_zero():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    for capacity in (1, 3):  # one slot: the row's only difference is -1 - 0
        _, empty = split_batch_metadata(packfn.batch_metadata(mask, max_documents=capacity), 2)
        assert_same(empty, packfn.batch_metadata(mask[1:], max_documents=capacity))
        assert int(empty.max_seqlen) == 0


def test_split_compiles_without_recompiles():
    torch._dynamo.reset()

    def split_then_flatten(mask):
        first, second = split_batch_metadata(packfn.batch_metadata(mask, max_documents=3), 2)
        return packfn.flatten_metadata(first.packed_token_indices, first.cu_seqlens).cu_seqlens, second.max_seqlen

    compiled = torch.compile(split_then_flatten, fullgraph=True, backend="aot_eager", dynamic=False)
    generator = torch.Generator().manual_seed(0)
    try:
        for step in range(4):
            mask = (torch.rand(4, 16, generator=generator) < 0.3).cumsum(1).clamp(1, 3)
            mask[:, 12 + step :] = 0
            assert_same(compiled(mask), split_then_flatten(mask))
            torch._dynamo.config.error_on_recompile = True
    finally:
        torch._dynamo.config.error_on_recompile = False


@pytest.mark.parametrize(
    ("metadata", "count", "error", "message"),
    [
        (packfn.batch_metadata(torch.ones(2, 3, dtype=torch.int64)), 3, ValueError, "num_microbatches=3 exceeds"),
        (
            packfn.batch_metadata(torch.ones(2, 3, dtype=torch.int64)),
            0,
            ValueError,
            "num_microbatches must be positive",
        ),
        (packfn.batch_metadata(torch.ones(2, 3, dtype=torch.int64)), True, TypeError, "must be an int"),
        (packfn.varlen_metadata(torch.ones(2, 3, dtype=torch.int64)), 1, TypeError, "must be a BatchMetadata"),
    ],
)
def test_split_argument_errors(metadata, count, error, message):
    with pytest.raises(error, match=message):
        split_batch_metadata(metadata, count)
