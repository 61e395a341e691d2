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
