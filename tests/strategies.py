"""Packing masks shared by the test modules: the worked example, broken masks, Hypothesis strategies, generators."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

MASK_DTYPES = (torch.bool, torch.uint8, torch.int32, torch.int64)

EXAMPLE = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
"""The worked example of the packing format (:mod:`packfn._ops.metadata`): documents of 2, 3 and 4 tokens."""

INCONSISTENT = {
    "id_reappears_after_another": (torch.tensor([[1, 1, 2, 1]]), "must not decrease"),
    "ids_out_of_order": (torch.tensor([[2, 2, 1, 0]]), "must not decrease"),
    "negative_id": (torch.tensor([[1, -1, 0]]), "negative"),
    "floating_mask": (torch.tensor([[1.0, 1.0, 0.0]]), "integer or bool"),
}
"""Masks upstream gets wrong (name to ``(mask, part of packfn's message)``): packfn raises instead."""


def fits_dtype(mask: torch.Tensor) -> bool:
    """Whether every document length fits the mask's dtype (upstream wraps silently otherwise)."""
    if mask.dtype == torch.bool:
        return True
    lengths = [(mask == value).sum().item() for value in mask.unique().tolist() if value]
    return max(lengths, default=0) <= torch.iinfo(mask.dtype).max


def documents_per_row(mask: torch.Tensor) -> int:
    """The most documents a row of ``mask`` holds."""
    return max(len(set(row) - {0}) for row in mask.to(torch.int64).tolist())


def random_mask(batch: int, sequence: int, seed: int, *, documents: int = 4, dtype=torch.int64) -> torch.Tensor:
    """Rows of up to ``documents`` contiguous documents, random padding at the end and inside."""
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.rand(batch, sequence, generator=generator) < (documents - 1) / sequence
    cuts[:, 0] = False
    ids = (cuts.cumsum(1) + 1).clamp_max(documents)
    keep = torch.rand(batch, sequence, generator=generator) > 0.1
    used = torch.randint(0, sequence + 1, (batch, 1), generator=generator)
    ids = ids * keep * (torch.arange(sequence) < used)
    ids[0, 0] = 1  # at least one valid token
    return (ids > 0) if dtype == torch.bool else ids.to(dtype)


def document_mask(batch: int, sequence: int, *, seed: int, documents: int = 4) -> torch.Tensor:
    """int64 ``[batch, sequence]``: up to ``documents`` contiguous documents per row, then padding."""
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.rand(batch, sequence, generator=generator) < (documents - 1) / sequence
    cuts[:, 0] = False
    ids = (cuts.cumsum(1) + 1).clamp_max(documents)
    used = torch.randint(sequence // 2, sequence + 1, (batch, 1), generator=generator)
    ids = ids * (torch.arange(sequence) < used)
    ids[:, 0] = 1  # every row holds a token
    return ids


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
