"""Hypothesis strategies for packing masks, shared by the test modules."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

MASK_DTYPES = (torch.bool, torch.uint8, torch.int32, torch.int64)


@st.composite
def mask_rows(draw, sequence: int, *, single_document: bool, max_id: int) -> list[int]:
    """One row of document ids: runs of padding and documents, ids never decreasing.

    A run either continues the current document (after padding inside it),
    starts the next id, or skips ids (a gap). The row may be all padding.
    """
    row: list[int] = []
    current = 0
    while len(row) < sequence:
        run = draw(st.integers(1, max(1, sequence // 2)))
        kind = draw(st.sampled_from(["pad", "next", "next", "gap", "same"]))
        if kind == "pad":
            value = 0
        elif single_document:
            value = 1
        elif kind == "same" and current > 0:
            value = current
        else:
            step = 1 if kind != "gap" else draw(st.integers(2, 4))
            value = min(current + step, max_id)
        current = max(current, value)
        row.extend([value] * run)
    return row[:sequence]


@st.composite
def packing_masks(
    draw,
    *,
    max_batch: int = 8,
    max_sequence: int = 512,
    dtypes: tuple[torch.dtype, ...] = MASK_DTYPES,
    allow_empty_rows: bool = True,
) -> torch.Tensor:
    """A ``[batch, sequence]`` packing mask: bool, or integer ids local to each row.

    Covers all-padding rows, padding at the ends and inside documents, gaps in
    ids, one-token documents, ids all 1 and large ids.
    """
    dtype = draw(st.sampled_from(dtypes))
    batch = draw(st.integers(1, max_batch))
    sequence = draw(st.integers(1, max_sequence))
    single = dtype == torch.bool or draw(st.booleans())
    max_id = 255 if dtype == torch.uint8 else 10_000
    rows = []
    for _ in range(batch):
        if allow_empty_rows and draw(st.integers(0, 9)) == 0:
            rows.append([0] * sequence)
        else:
            rows.append(draw(mask_rows(sequence, single_document=single, max_id=max_id)))
    mask = torch.tensor(rows, dtype=torch.int64)
    if dtype == torch.bool:
        return mask > 0
    return mask.to(dtype)
