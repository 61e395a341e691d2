"""Hypothesis strategies for context-parallel shards of packed batches, and plain references for them."""

from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

import packfn

from tests.strategies_layout import length_tables

BALANCES = ("rotated", "head_tail", "contiguous")


class ShardCase(NamedTuple):
    """Keyword arguments of ``shard_packed_batch`` (plus the length tables), always valid."""

    seq_lens: torch.Tensor
    seq_lens_padded: torch.Tensor | None
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    rank: int
    world: int
    budget: int
    alignment: int
    balance: str

    def kwargs(self, **changes) -> dict:
        fields = {**self._asdict(), **changes}
        names = ("input_ids", "labels", "loss_mask", "rank", "world", "budget", "alignment", "balance")
        return {name: fields[name] for name in names}

    @property
    def unit(self) -> int:
        """What the budget is a multiple of, and (balanced) what each document is rounded up to."""
        return self.world * self.alignment * (1 if self.balance == "contiguous" else 2)


@st.composite
def shard_cases(draw, *, max_world: int = 4, balances=BALANCES) -> ShardCase:
    """Valid length tables (absent slots, inner padding), 1..``max_world`` ranks and a budget every input fits.

    The budget is the worst-case aligned length (contiguous: any input of
    the row length; balanced: these documents, each rounded up to
    ``2 * world * alignment``) rounded up to its multiple, plus 0..2 more
    such multiples (rows with slack).
    """
    lengths, spans, padded = draw(length_tables(max_batch=3, max_documents=5, max_length=12))
    batch = len(lengths)
    widest = max(
        (
            sum(span for length, span in zip(row, row_spans, strict=True) if length > 0)
            for row, row_spans in zip(lengths, spans, strict=True)
        ),
        default=0,
    )
    sequence = max(1, widest + draw(st.integers(0, 4)))
    world = draw(st.integers(1, max_world))
    alignment = draw(st.sampled_from([1, 2, 4]))
    balance = draw(st.sampled_from(balances))
    if balance == "contiguous":
        unit = world * alignment
        fits = packfn.safe_budget(sequence, len(lengths[0]), alignment)
    else:
        unit = 2 * world * alignment
        fits = max(sum(-(-max(length, 0) // unit) * unit for length in row) for row in lengths)
    budget = max(unit, (fits + unit - 1) // unit * unit) + unit * draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    return ShardCase(
        seq_lens=torch.tensor(lengths, dtype=torch.int64).reshape(batch, -1),
        seq_lens_padded=torch.tensor(spans, dtype=torch.int64).reshape(batch, -1) if padded else None,
        input_ids=torch.randint(1, 1000, (batch, sequence), generator=generator),
        labels=torch.randint(0, 1000, (batch, sequence), generator=generator),
        loss_mask=torch.rand(batch, sequence, generator=generator),
        rank=draw(st.integers(0, world - 1)),
        world=world,
        budget=budget,
        alignment=alignment,
        balance=balance,
    )


# ------------------------------------------------------------------ references


class RowTables(NamedTuple):
    """A whole packed row by loops (int64 ``[batch, budget]``): the input column, position and slot id per column."""

    source_indices: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor

    def at(self, columns: torch.Tensor) -> RowTables:
        """The same tables read at ``columns`` ``[batch, n]``."""
        return RowTables(*(table.gather(1, columns) for table in self))

    def real_inputs(self, sequence: int) -> torch.Tensor:
        """bool ``[batch, sequence]``: the input columns that this row reads (its real tokens)."""
        read = torch.where(self.source_indices >= 0, self.source_indices, sequence)  # padding: a spare column
        return torch.zeros(read.shape[0], sequence + 1, dtype=torch.bool).scatter_(1, read, True)[:, :sequence]

    def pack(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        """``values`` ``[batch, sequence]`` laid out in this row, ``fill`` at padding."""
        read = values.gather(1, self.source_indices.clamp_min(0))
        return torch.where(self.source_indices >= 0, read, torch.full_like(read, fill))


def reference_row(case: ShardCase) -> RowTables:
    """The whole packed row, in width order, by loops.

    Contiguous: each document at the next multiple of ``alignment``.
    Balanced: each document in a width of its length rounded up to
    ``2 * world * alignment``, its tokens first (``"head_tail"``) or after its
    padding (``"rotated"``).
    """
    batch = case.seq_lens.shape[0]
    lengths = case.seq_lens.reshape(batch, -1).tolist()
    spans = lengths if case.seq_lens_padded is None else case.seq_lens_padded.reshape(batch, -1).tolist()
    tables = [[[-1] * case.budget for _ in range(batch)], [[0] * case.budget for _ in range(batch)]]
    tables.append([[0] * case.budget for _ in range(batch)])
    unit = case.alignment if case.balance == "contiguous" else case.unit
    for row in range(batch):
        column = source = 0
        for slot, (length, span) in enumerate(zip(lengths[row], spans[row], strict=True)):
            width = -(-length // unit) * unit
            lead = width - length if case.balance == "rotated" else 0
            for position in range(length):
                tables[0][row][column + lead + position] = source + position
                tables[1][row][column + lead + position] = position
                tables[2][row][column + lead + position] = slot + 1
            column, source = column + width, source + (span if length else 0)
    return RowTables(*(torch.tensor(table, dtype=torch.int64) for table in tables))


def head_tail_columns(widths: list[int], world: int, rank: int, rotation: list[int] | None = None) -> list[int]:
    """Megatron's documented Transformer Engine partition, by loops: chunks ``p`` and ``2W - 1 - p`` of each span.

    Each span (a document's width, then the row's padding) is cut into
    ``2 * world`` equal chunks; rank ``rank`` takes, in span order, chunk
    ``p`` and chunk ``2 * world - 1 - p`` of each, with ``p = rank`` (pure
    head-tail) or ``p = (rank + rotation[k]) % world``.
    """
    columns, start = [], 0
    for k, width in enumerate(widths):
        chunk = width // (2 * world)
        pair = rank if rotation is None else (rank + rotation[k]) % world
        for index in (pair, 2 * world - 1 - pair):
            columns += range(start + index * chunk, start + (index + 1) * chunk)
        start += width
    return columns


def reference_columns(case: ShardCase) -> torch.Tensor:
    """int64 ``[batch, budget]``: the row column of each gathered column (every rank's shard in rank order)."""
    if case.balance == "contiguous":
        return torch.arange(case.budget).expand(case.seq_lens.shape[0], -1)
    rows = []
    count = 0  # present documents before this one, batch-major (the rotation)
    for lengths in case.seq_lens.reshape(case.seq_lens.shape[0], -1).tolist():
        widths = [-(-max(length, 0) // case.unit) * case.unit for length in lengths]
        rotation = []
        for length in lengths:
            rotation.append(count % case.world if case.balance == "rotated" else 0)
            count += length > 0
        widths.append(case.budget - sum(widths))
        rotation.append(0)
        rows.append(
            [column for rank in range(case.world) for column in head_tail_columns(widths, case.world, rank, rotation)]
        )
    return torch.tensor(rows, dtype=torch.int64)
