"""Hypothesis strategies for packed batches as a packer emits them, in every format the format tests convert."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from hypothesis import strategies as st

from tests.references import ids_from_lengths


@dataclass(frozen=True)
class PackedRows:
    """Rows of contiguous documents from column 0, then padding: what a packer emits.

    Attributes:
        sequence: columns per row.
        lengths: per row, its documents' lengths (each at least 1, adding up to at most ``sequence``).
    """

    sequence: int
    lengths: tuple[tuple[int, ...], ...]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def max_documents(self) -> int:
        return max(1, max(len(row) for row in self.lengths))

    @cached_property
    def document_ids(self) -> torch.Tensor:
        return ids_from_lengths(self.sequence, [list(row) for row in self.lengths])

    @cached_property
    def seq_lens(self) -> torch.Tensor:
        """int64 ``[batch, max_documents]``: the lengths, then zeros."""
        table = torch.zeros(self.batch, self.max_documents, dtype=torch.int64)
        for row, lengths in enumerate(self.lengths):
            table[row, : len(lengths)] = torch.tensor(lengths, dtype=torch.int64)
        return table

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """int64 ``[batch, max_documents + 1]``: row-local boundaries, then -1 (packfn.batch_metadata's form)."""
        table = torch.full((self.batch, self.max_documents + 1), -1, dtype=torch.int64)
        for row, lengths in enumerate(self.lengths):
            running = [0]
            for n in lengths:
                running.append(running[-1] + n)
            table[row, : len(running)] = torch.tensor(running)
        return table


@st.composite
def packed_rows(
    draw,
    *,
    max_batch: int = 4,
    max_sequence: int = 40,
    min_sequence: int = 1,
    allow_empty_rows: bool = True,
    padding: bool = True,
) -> PackedRows:
    """A :class:`PackedRows`: one-token documents, full rows, padding tails, empty rows (unless excluded)."""
    batch = draw(st.integers(1, max_batch))
    sequence = draw(st.integers(min_sequence, max_sequence))
    rows = []
    for index in range(batch):
        lengths: list[int] = []
        used = 0
        while used < sequence:
            may_stop = padding and (lengths or (allow_empty_rows and index > 0))
            if may_stop and draw(st.integers(0, 5)) == 0:
                break
            length = draw(st.one_of(st.just(1), st.integers(1, sequence - used)))
            lengths.append(length)
            used += length
        rows.append(tuple(lengths))
    return PackedRows(sequence, tuple(rows))
