"""Values with a 0-sized trailing axis move through unpad / pad and pack / restore, eager and compiled."""

from __future__ import annotations

import pytest
import torch

import packfn

DOCUMENT_IDS = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])


def round_trips(document_ids: torch.Tensor, values: torch.Tensor):
    metadata = packfn.varlen_metadata(document_ids, max_documents=2)
    layout = packfn.aligned_layout(
        torch.tensor([[2, 3], [4, 0]]), sequence_length=document_ids.shape[1], alignment=2, budget=8
    )
    return packfn.pad(packfn.unpad(values, metadata), metadata), layout.restore(layout.pack(values))


@pytest.mark.parametrize("trailing", [(0,), (3, 0), (0, 2)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_zero_sized_trailing_axes_round_trip(trailing, compiled):
    function = torch.compile(round_trips, fullgraph=True) if compiled else round_trips
    values = torch.randn(2, 6, *trailing)
    for result in function(DOCUMENT_IDS, values):
        assert result.shape == values.shape


@pytest.mark.parametrize("trailing", [(), (3,), (0,)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_rows_of_no_columns_pack_to_the_fill_and_restore_to_nothing(trailing, compiled):
    """``sequence_length=0``: no token to read, so every aligned column is the fill (a gather from the empty axis
    raised IndexError); restore, and pack's gradient, give rows of no columns."""
    layout = packfn.aligned_layout(torch.zeros(2, 1, dtype=torch.int64), sequence_length=0, alignment=2, budget=4)
    pack = torch.compile(layout.pack, fullgraph=True) if compiled else layout.pack
    values = torch.zeros(2, 0, *trailing, requires_grad=True)
    packed = pack(values, fill=-3.0)
    assert torch.equal(packed, torch.full((2, 4, *trailing), -3.0))
    (gradient,) = torch.autograd.grad(packed.sum(), values)
    assert gradient.shape == values.shape
    assert layout.restore(packed).shape == values.shape
