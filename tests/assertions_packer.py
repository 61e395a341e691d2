"""Assertions the packer tests share: every batch fits the static budgets, as the ops and the rows see it."""

from __future__ import annotations

import torch

from packfn import aligned_layout, batch_metadata, varlen_metadata
from packfn.data import CLOSED_BY, PackedBatch

from tests.strategies_packer import Budgets, round_up


def assert_fits_the_static_ops(packed: PackedBatch, limits: Budgets) -> None:
    """The guarantee: both static ops accept the batch (their eager asserts raise RuntimeError otherwise)."""
    cap = limits.max_documents
    varlen_metadata(packed.document_ids, max_documents=cap)
    parsed = batch_metadata(packed.document_ids, max_documents=cap)
    ends = parsed.cu_seqlens[:, 1:].to(torch.int64)
    lengths = torch.where(ends >= 0, ends - parsed.cu_seqlens[:, :-1], 0)
    assert torch.equal(lengths, packed.seq_lens), "the document-id mask and seq_lens disagree"
    layout = aligned_layout(
        packed.seq_lens,
        packed.seq_lens_padded,
        sequence_length=limits.sequence,
        alignment=limits.alignment,
        budget=packed.budget,
    )
    # The real tokens fit: packing token values into the aligned rows and back loses none of them.
    values = torch.arange(1, packed.batch * limits.sequence + 1).view(packed.batch, limits.sequence)
    values = torch.where(packed.document_ids > 0, values, 0)
    aligned = layout.pack(values)
    assert aligned.shape == (packed.batch, packed.budget)
    assert torch.equal(aligned[aligned > 0].sort().values, values[values > 0].sort().values)
    assert torch.equal(layout.restore(aligned), values)


def assert_rows_within_budgets(packed: PackedBatch, limits: Budgets) -> None:
    assert packed.budget == limits.resolved_budget and packed.budget % limits.alignment == 0
    assert packed.document_ids.shape == (packed.batch, limits.sequence)
    assert packed.seq_lens.shape == packed.seq_lens_padded.shape == (packed.batch, limits.max_documents)
    assert packed.document_ids.dtype == packed.seq_lens.dtype == packed.seq_lens_padded.dtype == torch.int64
    assert len(packed.closed_by) == packed.batch and set(packed.closed_by) <= set(CLOSED_BY)
    for row, pieces in enumerate(packed.rows):
        assert len(pieces) <= limits.max_documents
        assert sum(piece.span for piece in pieces) <= limits.sequence
        assert sum(round_up(piece.length, limits.alignment) for piece in pieces) <= packed.budget
        column = 0
        for slot, piece in enumerate(pieces):
            assert piece.column == column, "documents sit back to back"
            assert piece.span == round_up(piece.length, limits.pad_to_multiple_of)
            assert packed.seq_lens[row, slot] == piece.length
            assert packed.seq_lens_padded[row, slot] == piece.span
            assert (packed.document_ids[row, column : column + piece.length] == slot + 1).all()
            assert (packed.document_ids[row, column + piece.length : column + piece.span] == 0).all()
            column += piece.span
        assert (packed.document_ids[row, column:] == 0).all()
        assert (packed.seq_lens[row, len(pieces) :] == 0).all()
        assert (packed.seq_lens_padded[row, len(pieces) :] == 0).all()
        # Documents sit in input order within a row.
        assert [(piece.document, piece.offset) for piece in pieces] == sorted((p.document, p.offset) for p in pieces)
