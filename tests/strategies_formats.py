"""Hypothesis strategies for packed batches as a packer emits them, in every format the format tests convert."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from hypothesis import strategies as st

import packfn

from tests.references import eos_stream, ids_from_lengths, position_ids_reference
from tests.strategies import EXAMPLE as EXAMPLE_IDS


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


def batch_in_every_format(sequence: int, seed: int, batch: int = 3) -> tuple[torch.Tensor, ...]:
    """A packed batch of at most 4 documents a row (row 0 never empty), in each format ``every_format`` takes."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for row in range(batch):
        lengths, used = [], 0
        while used < sequence and len(lengths) < 4:
            length = int(torch.randint(1, sequence - used + 1, (), generator=generator))
            if row and torch.rand((), generator=generator) < 0.25:
                break
            lengths.append(length)
            used += length
        rows.append(tuple(lengths))
    packed = PackedRows(sequence, tuple(rows))
    ids = packed.document_ids
    seq_lens = torch.nn.functional.pad(packed.seq_lens, (0, 4 - packed.seq_lens.shape[1]))
    cu_rows = torch.nn.functional.pad(packed.cu_seqlens, (0, 5 - packed.cu_seqlens.shape[1]), value=-1)
    tokens = eos_stream(sequence, [list(r) for r in rows], eos=3, pad=0, tail=[False] * batch)
    cu_flat = packfn.physical_varlen_metadata(ids).cu_seqlens
    return ids, position_ids_reference(ids), tokens, seq_lens, cu_rows, cu_flat, packfn.seq_idx_from_document_ids(ids)


def op_samples():
    ids, positions, tokens, seq_lens, cu_rows, cu_flat, seq_idx = batch_in_every_format(9, seed=3)
    valid = ids > 0
    yield "position_ids", (ids,)
    yield "position_ids", (torch.tensor([[0, 3, 3, 0, 3, 7, 7, 9, 9, 0, 0]], dtype=torch.int32),)
    yield "position_ids", (EXAMPLE_IDS > 0,)
    yield "document_positions", (ids.to(torch.uint8),)
    yield "document_positions", (torch.tensor([[0, 3, 3, 0, 3, 7, 7, 9, 9, 0, 0]]),)
    yield "document_positions", (torch.zeros(2, 1, dtype=torch.int64),)
    yield "document_ids_from_position_ids", (positions, None, None, 0)
    yield "document_ids_from_position_ids", (positions.int(), valid, None, None)
    yield "document_ids_from_position_ids", (positions.masked_fill(~valid, -1), None, -1, 0)
    yield (
        "document_ids_from_position_ids",
        (torch.cat([torch.arange(256), torch.arange(3)]).to(torch.uint8)[None], None, None, 0),
    )
    yield "document_ids_from_eos", (tokens, None, [3], False, 0, 16, True, True, True)
    yield "document_ids_from_eos", (tokens.int(), valid, [3, 5], True, None, None, False, True, False)
    yield "document_ids_from_eos", (tokens, None, [3], False, None, None, True, False, False)
    yield "document_ids_from_eos", (tokens.to(torch.uint8), None, [3, 259], False, 256, 300, True, True, False)
    yield "document_ids_from_seq_lens", (seq_lens, 9)
    yield "document_ids_from_seq_lens", (seq_lens.int(), 12)
    yield "document_ids_from_seq_lens", (torch.zeros(2, 0, dtype=torch.int64), 3)
    yield "document_ids_from_seq_lens", (torch.tensor([[2**62] * 4 + [2], [1, 0, 0, 0, 0]]), 4)  # a sum that wraps
    yield "document_ids_from_cu_seqlens", (cu_rows, 3, 9, None)
    yield "document_ids_from_cu_seqlens", (cu_flat, 3, 9, valid)
    yield "document_ids_from_cu_seqlens", (torch.tensor([0, 3, 5, 6], dtype=torch.int32), 1, 6, None)
    yield "document_ids_from_seq_idx", (seq_idx, None, -1)
    yield "document_ids_from_seq_idx", (seq_idx.long(), valid, None)
    yield "document_ids_from_seq_idx", (torch.tensor([[0, 0, 1, 2]]), None, None)
    yield "seq_idx_from_document_ids", (ids, -1)
    yield "seq_idx_from_document_ids", (EXAMPLE_IDS > 0, 7)
    yield "seq_idx_from_document_ids", (torch.tensor([[0, 3, 3, 0, 5]], dtype=torch.int32), -1)
    yield "seq_idx_from_document_ids", (torch.tensor([[0, 2**32, 2**32 + 1]]), -1)  # beyond int32
    yield "thd_metadata", (ids, 4)
    yield "thd_metadata", (EXAMPLE_IDS.int(), 300)
    yield "thd_metadata", (EXAMPLE_IDS > 0, 1)
