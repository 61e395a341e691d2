"""Hypothesis strategies for the attention tests: masks as a packer writes them."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

PACKED_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool)


@st.composite
def packed_batches(draw, *, max_batch: int = 3, max_sequence: int = 24, dtypes=PACKED_DTYPES) -> torch.Tensor:
    """A ``[batch, sequence]`` mask as a packer writes it: whole documents, padding only between and after them.

    (No padding inside a document, so every representation, physical varlen
    included, sees the same documents.) Rows may be all padding.
    """
    dtype = draw(st.sampled_from(dtypes))
    batch = draw(st.integers(1, max_batch))
    sequence = draw(st.integers(1, max_sequence))
    rows = []
    for _ in range(batch):
        row: list[int] = []
        document = 0
        while len(row) < sequence:
            if draw(st.integers(0, 3)) == 0:
                row.extend([0] * draw(st.integers(1, 4)))
            elif dtype != torch.bool or document == 0:
                document += 1
                row.extend([document] * draw(st.integers(1, 9)))
            else:
                row.extend([0] * (sequence - len(row)))
        rows.append(row[:sequence])
    mask = torch.tensor(rows, dtype=torch.int64)
    return mask > 0 if dtype == torch.bool else mask.to(dtype)
