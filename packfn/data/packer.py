"""Dense packing of documents into rows of fixed budgets (the data-loader side).

The static ops take fixed budgets: ``varlen_metadata(..., max_documents=D)``
holds at most ``D`` documents per row, and ``aligned_layout(..., budget=L)``
holds a row whose documents, each rounded up to ``alignment`` columns, take
at most ``L`` columns. :func:`packfn.safe_budget` gives the ``L`` that fits
*any* row of ``sequence`` tokens and ``D`` documents, which is up to
``D * (alignment - 1)`` columns wider than the tokens (752 columns for 512
tokens, 16 documents, alignment 16): attention then covers that much more
area. A packer that counts each document at its aligned size while it fills
rows guarantees a tighter ``L`` (by default the input row length itself),
so the static budgets cost no extra area.

This module is that packer. It is plain Python over document lengths, for a
data loader's worker (no op, no graph): :func:`pack_documents` packs a list,
:func:`pack_stream` turns a stream into batches of a fixed number of rows,
:func:`suggest_budgets` proposes a budget and a document cap from a sample
of lengths. :mod:`packfn.data.loader` is a loader over tokenized examples built on it.

Rules (``a = alignment``, ``m = pad_to_multiple_of``):

- A row holds documents back to back: a document of ``n`` real tokens takes
  ``round_up(n, m)`` input columns (its physical span: ``n`` tokens, then
  ``span - n`` padding columns) and ``round_up(n, a)`` aligned columns. A
  row's spans fit ``sequence``, its aligned sizes fit ``budget``, and it
  holds at most ``max_documents`` documents.
- ``strategy="best_fit"`` (the default) is best-fit decreasing: the
  documents of a window (the whole list for :func:`pack_documents`, a
  bounded buffer for :func:`pack_stream`) are taken longest first, each into
  the open row it fills most tightly, or a new row when none has room
  (NOTE [Best fit under several budgets]). Rows come out ordered by their
  first document, and documents sit in input order within a row.
- ``strategy="next_fit"`` keeps the input order, across rows too: a row
  takes documents until the next one does not fit, which starts the next row.
- A document that does not fit even an empty row raises ``ValueError``,
  unless ``split=True``; then it is cut into pieces, each a document of its
  own for the metadata and for attention. Best fit cuts it into pieces that
  each fill an empty row, and a last piece of the rest, which is packed like
  any document; next fit cuts each piece as long as the row it lands in
  allows. Documents that fit an empty row are never split, and no document
  is lost or repeated.

Every batch satisfies, with no assert tripping::

    packfn.varlen_metadata(batch.document_ids, max_documents=max_documents)
    packfn.aligned_layout(batch.seq_lens, batch.seq_lens_padded,
                          sequence_length=sequence, alignment=alignment, budget=budget)

and ``batch_metadata(document_ids, max_documents=...)`` recovers ``seq_lens``.

The fitting itself is :mod:`packfn.data.fit` (NOTE [Best fit under several budgets]).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from packfn._checks import check_bool, check_positive_int
from packfn._utils import round_up
from packfn.data.batch import (
    CLOSED_BUDGET,
    CLOSED_BY,
    CLOSED_DOCUMENTS,
    CLOSED_END,
    CLOSED_TOKENS,
    PackedBatch,
    Pieces,
    document_ids,
)
from packfn.data.fit import (
    Budgets,
    Items,
    Plan,
    best_fit_rows,
    check_iterable,
    checked_budgets,
    lengths_tensor,
    next_fit_rows,
    split_items,
)

__all__ = ["pack_documents", "pack_stream"]


def plan_rows(items: Items, carried_row: torch.Tensor, budgets: Budgets) -> Plan:
    """Pack a window: its carried pieces (the first ``len(carried_row)`` items, in their rows) and new documents."""
    sequence, alignment, cap, budget, multiple = budgets[:5]
    if budgets.strategy == "best_fit":
        carried = carried_row.shape[0]
        item, offset, length = split_items(Items(*(field[carried:] for field in items)), budgets)
        item = torch.cat([torch.arange(carried), item + carried])
        offset = torch.cat([items.offset[:carried], offset])
        length = torch.cat([items.length[:carried], length])
        row, rows = best_fit_rows(length, carried_row, budgets)
        closed = None
    else:
        item, offset, length, row, closed, rows = (
            torch.tensor(values, dtype=torch.int64) if isinstance(values, list) else values
            for values in next_fit_rows(items, carried_row, budgets)
        )
    pieces = row.shape[0]
    # Rows ordered by their first piece (rows a pass opened but left empty go last, and are dropped).
    first = torch.full((rows,), pieces, dtype=torch.int64).scatter_reduce_(0, row, torch.arange(pieces), "amin")
    by_first = torch.argsort(first)
    rank = torch.empty(rows, dtype=torch.int64).index_copy_(0, by_first, torch.arange(rows))
    if closed is not None:
        closed = closed.index_select(0, by_first)
    rows = int((first < pieces).sum())
    row, order = torch.sort(rank.index_select(0, row), stable=True)
    item, offset, length = (values.index_select(0, order) for values in (item, offset, length))
    count = torch.bincount(row, minlength=rows)
    starts = torch.cumsum(count, 0) - count
    slot = torch.arange(pieces) - starts.index_select(0, row)
    span = round_up(length, multiple)
    before = torch.cumsum(span, 0) - span  # input columns of the pieces before each one
    column = before - before.index_select(0, starts).index_select(0, row)
    used_span = torch.zeros(rows, dtype=torch.int64).index_add_(0, row, span)
    used_aligned = torch.zeros(rows, dtype=torch.int64).index_add_(0, row, round_up(length, alignment))
    at_cap = count >= cap
    if closed is None:
        smallest = int(length.min()) if pieces else 1
        closed = torch.where(
            used_span + round_up(smallest, multiple) > sequence,
            CLOSED_TOKENS,
            torch.where(
                at_cap,
                CLOSED_DOCUMENTS,
                torch.where(used_aligned + round_up(smallest, alignment) > budget, CLOSED_BUDGET, CLOSED_END),
            ),
        )
    else:
        closed = closed[:rows]
    fullness = torch.where(at_cap, 1.0, torch.maximum(used_span / sequence, used_aligned / budget))
    return Plan(
        rows, row, slot, item, offset, length, span, column, count, first.sort().values[:rows], closed, fullness
    )


def packed_batch(plan: Plan, items: Items, selected: torch.Tensor | None, batch: int, budgets: Budgets) -> PackedBatch:
    """The :class:`PackedBatch` of ``selected`` rows of a plan (all, in order, when None), padded to ``batch`` rows."""
    return batch_and_items(plan, items, selected, batch, budgets)[0]


def batch_and_items(
    plan: Plan, items: Items, selected: torch.Tensor | None, batch: int, budgets: Budgets
) -> tuple[PackedBatch, torch.Tensor]:
    """:func:`packed_batch`, and the item each of its pieces comes from (int64 ``[pieces]``)."""
    sequence, cap = budgets.sequence, budgets.max_documents
    fields = (plan.slot, plan.item, plan.offset, plan.length, plan.span, plan.column)
    if selected is None:
        row, closed = plan.row, plan.closed
    else:  # the pieces of the selected rows, renumbered in their order
        position = torch.full((plan.rows,), -1, dtype=torch.int64)
        position.index_copy_(0, selected, torch.arange(selected.shape[0]))
        new_row = position.index_select(0, plan.row)
        keep = torch.argsort(torch.where(new_row >= 0, new_row, selected.shape[0]), stable=True)
        keep = keep[: int(plan.count.index_select(0, selected).sum())]
        row, closed = new_row.index_select(0, keep), plan.closed.index_select(0, selected)
        fields = tuple(field.index_select(0, keep) for field in fields)
    slot, item, offset, length, span, column = fields
    codes = torch.full((batch,), CLOSED_END, dtype=torch.int64)
    codes[: closed.shape[0]] = closed
    at = row * cap + slot
    seq_lens = torch.zeros(batch, cap, dtype=torch.int64)
    seq_lens.view(-1).index_copy_(0, at, length)
    if budgets.multiple == 1:
        seq_lens_padded = seq_lens.clone()
    else:
        seq_lens_padded = torch.zeros(batch, cap, dtype=torch.int64)
        seq_lens_padded.view(-1).index_copy_(0, at, span)
    packed = PackedBatch(
        document_ids=document_ids(row, slot, column, length, batch, sequence),
        seq_lens=seq_lens,
        seq_lens_padded=seq_lens_padded,
        sequence=sequence,
        alignment=budgets.alignment,
        budget=budgets.budget,
        max_documents=cap,
        pieces=Pieces(
            row,
            slot,
            items.document.index_select(0, item),
            offset,
            length,
            span,
            column,
            items.total.index_select(0, item),
        ),
        closed_by=tuple(CLOSED_BY[code] for code in codes.tolist()),
        num_tokens=int(length.sum()),
    )
    return packed, item


# ------------------------------------------------------------------ the public functions


def pack_documents(
    lengths: Iterable[int],
    *,
    sequence: int,
    alignment: int,
    max_documents: int,
    budget: int | None = None,
    batch: int | None = None,
    pad_to_multiple_of: int = 1,
    split: bool = False,
    strategy: str = "best_fit",
) -> PackedBatch:
    """Pack documents densely into rows that fit the static budgets.

    Args:
        lengths: Real token count of each document (positive ints: a list,
            an integer tensor or array), in order.
        sequence: Input row length (columns of ``document_ids``).
        alignment: Alignment of document starts in the aligned rows.
        max_documents: Most documents (pieces) per row, ``D`` of the metadata ops.
        budget: Aligned row length, a positive multiple of ``alignment``
            (default ``round_up(sequence, alignment)``: the aligned rows
            are no wider than the input rows).
        batch: Rows of the result (default: as many as the documents need).
            Rows past the documents are all padding.
        pad_to_multiple_of: Each document's physical span in the input row
            is its length rounded up to this (``seq_lens_padded``; 1: back
            to back). At most ``sequence``.
        split: Cut documents that do not fit an empty row into pieces
            (see the module docstring); otherwise such a document raises.
        strategy: ``"best_fit"`` (best-fit decreasing over the whole list,
            the densest) or ``"next_fit"`` (input order kept).

    Returns:
        :class:`PackedBatch` with ``document_ids`` int64 ``[batch, sequence]``
        and ``seq_lens`` / ``seq_lens_padded`` int64 ``[batch, max_documents]``.

    Raises:
        TypeError: an argument or a length that is not an int (bools
            included), or ``lengths`` that is not iterable.
        ValueError: a length below 1 or past int64; a budget that is not
            a multiple of ``alignment``; ``pad_to_multiple_of > sequence``;
            an unknown strategy; a document that does not fit an empty row
            without ``split``; documents that need more than ``batch`` rows;
            no document with ``batch`` unset.

    Example (``sequence=16, alignment=4, max_documents=3``, so ``budget=16``)::

        >>> packed = pack_documents([4, 3, 12, 2, 7], sequence=16, alignment=4, max_documents=3)
        >>> [[piece.document for piece in row] for row in packed.rows]
        [[0, 2], [1, 3, 4]]
        >>> packed.seq_lens.tolist()
        [[4, 12, 0], [3, 2, 7]]
        >>> packed.document_ids[0].tolist()
        [1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]
        >>> packed.closed_by
        ('tokens', 'documents')
        >>> packed.budget, packed.fill_ratio  # vs safe_budget(16, 3, 4) == 24 columns
        (16, 0.875)
        >>> pack_documents([4, 3, 12, 2, 7], sequence=16, alignment=4, max_documents=3, strategy="next_fit").batch
        3

    Longest first, each into the row it fills most tightly: 12 (12 aligned
    columns) opens row A, 7 (8) opens row B, 4 (4) fills A, 3 and 2 (4 each)
    fill B; rows are then ordered by their first document. Row 0 is full of
    tokens; row 1 holds ``max_documents``. Next fit, in order, closes a row
    after 4 and 3 (12 does not fit) and needs three. ``split=True`` would
    cut a 20-token document into pieces of 16 and 4.
    """
    budgets = checked_budgets(sequence, alignment, max_documents, budget, pad_to_multiple_of, split, strategy)
    if batch is not None:
        batch = check_positive_int(batch, "batch")
    values = lengths_tensor(lengths)
    count = values.shape[0]
    items = Items(torch.arange(count), torch.zeros(count, dtype=torch.int64), values, values)
    plan = plan_rows(items, torch.zeros(0, dtype=torch.int64), budgets)
    if batch is None:
        if not plan.rows:
            raise ValueError("no document to pack: pass batch=... for a batch of empty rows")
        batch = plan.rows
    elif plan.rows > batch:
        raise ValueError(f"the documents need {plan.rows} rows, more than batch={batch}")
    return packed_batch(plan, items, None, batch, budgets)


def pack_stream(
    lengths: Iterable[int],
    *,
    batch: int,
    sequence: int,
    alignment: int,
    max_documents: int,
    budget: int | None = None,
    pad_to_multiple_of: int = 1,
    split: bool = False,
    drop_last: bool = False,
    strategy: str = "best_fit",
    window: int = 1000,
) -> Iterator[PackedBatch]:
    """Pack a stream of documents into batches of ``batch`` rows each (lazily, a window at a time).

    The stream is read ``window`` documents at a time. Each window is packed
    as :func:`pack_documents` packs a list, together with the rows carried
    from the window before; the fullest rows leave in whole batches and the
    rest (1 to ``batch`` rows) are carried into the next window, where they
    take more documents (NOTE [Windows and carried rows]). So every batch
    has the same shapes, memory stays bounded, and a carried row leaves with
    the next window that packs more than a batch of rows (the one after it
    was read, when windows hold more than a batch). With
    ``strategy="next_fit"`` the rows are
    exactly those of :func:`pack_documents` over the whole stream, cut into
    batches in order.

    Args:
        lengths: Real token counts (an iterable, possibly endless).
        batch: Rows per batch.
        sequence, alignment, max_documents, budget, pad_to_multiple_of, split, strategy:
            as in :func:`pack_documents`.
        drop_last: Drop the last batch when the stream ends before it is
            full (otherwise it is padded with empty rows).
        window: Documents read per window (best fit packs each window
            densest first; larger windows pack a little denser, hold more
            documents in memory and delay them longer).

    Yields:
        :class:`PackedBatch` whose :class:`Piece` ``document`` indices count
        from the start of the stream.

    Raises:
        TypeError, ValueError: as :func:`pack_documents`: bad arguments at
            the call, a bad document when the stream reaches it.
    """
    budgets = checked_budgets(sequence, alignment, max_documents, budget, pad_to_multiple_of, split, strategy)
    batch = check_positive_int(batch, "batch")
    window = check_positive_int(window, "window")
    drop_last = check_bool(drop_last, "drop_last")
    check_iterable(lengths)
    return _stream(iter(lengths), batch, budgets, drop_last, window)


# NOTE [Windows and carried rows]
# A stream is packed a window of documents at a time. After a window is
# packed (with the rows carried from the one before as rows already open),
# ((rows - 1) // batch) * batch rows leave, in whole batches, and the other
# 1 to batch rows are carried: they stay open for the next window's
# documents, so the half-empty rows a window ends with are filled by the
# next one instead of leaving as they are. Best fit sends out the rows
# carried before first, then the fullest (a row at the document cap counts
# as full), so a row is carried at most once while the windows fill more
# than a batch; next fit sends out rows in order and keeps its open row
# last, so it is the whole stream's next fit. At the end of the stream every
# row leaves. The carried rows are the packing's whole state between
# windows: the loader (packfn.data) checkpoints them with the stream
# position of the window, and a restored loader packs the same window the
# same way again (packing is deterministic) and skips the batches already sent.


class Carry(NamedTuple):
    """Rows carried between windows: their pieces (as items, row by row) and how many windows each was carried."""

    items: Items
    row: torch.Tensor  # row of each carried piece, 0 .. rows - 1, nondecreasing
    age: torch.Tensor  # per carried row

    @staticmethod
    def empty() -> Carry:
        none = torch.zeros(0, dtype=torch.int64)
        return Carry(Items(none, none, none, none), none, none)


class Window(NamedTuple):
    """A packed window: the plan, its items (carried pieces first), the rows of each batch that leaves, the carry."""

    plan: Plan
    items: Items
    batches: list[torch.Tensor]
    carried_pieces: torch.Tensor  # indices into the plan's pieces, carried row by row
    carry: Carry


def pack_window(carry: Carry, new: Items, budgets: Budgets, batch: int, final: bool) -> Window:
    """Pack one window (NOTE [Windows and carried rows])."""
    items = Items(*(torch.cat([old, added]) for old, added in zip(carry.items, new, strict=True)))
    plan = plan_rows(items, carry.row, budgets)
    rows = plan.rows
    leaving = rows if final else (rows - 1) // batch * batch if rows else 0
    age = torch.cat([carry.age + 1, torch.zeros(rows - carry.age.shape[0], dtype=torch.int64)])
    if budgets.strategy == "next_fit" or leaving in (0, rows):
        sent, kept = torch.arange(leaving), torch.arange(leaving, rows)
    else:
        # Carried rows first, then the fullest, then by first piece (a stable sort on each key in turn).
        order = torch.argsort(plan.fullness, descending=True, stable=True)
        order = order.index_select(0, torch.argsort(age.index_select(0, order), descending=True, stable=True))
        sent, kept = order[:leaving].sort().values, order[leaving:].sort().values
    batches = list(sent.split(batch)) if leaving else []
    # The carried rows' pieces, renumbered 0 .. kept - 1 in row order.
    position = torch.full((rows,), -1, dtype=torch.int64).index_copy_(0, kept, torch.arange(kept.shape[0]))
    new_row = position.index_select(0, plan.row)
    pieces = torch.nonzero(new_row >= 0).reshape(-1)
    pieces = pieces.index_select(0, torch.argsort(new_row.index_select(0, pieces), stable=True))
    item = plan.item.index_select(0, pieces)
    carried_items = Items(
        items.document.index_select(0, item),
        plan.offset.index_select(0, pieces),
        plan.length.index_select(0, pieces),
        items.total.index_select(0, item),
    )
    carry = Carry(carried_items, new_row.index_select(0, pieces), age.index_select(0, kept))
    return Window(plan, items, batches, pieces, carry)


def _stream(lengths: Iterator, batch: int, budgets: Budgets, drop_last: bool, window: int) -> Iterator[PackedBatch]:
    carry, read = Carry.empty(), 0
    while True:
        chunk = list(itertools.islice(lengths, window))
        final = len(chunk) < window  # a full window that happens to end the stream leaves its rows one window later
        values = lengths_tensor(chunk, first=read)
        count = values.shape[0]
        new = Items(torch.arange(read, read + count), torch.zeros(count, dtype=torch.int64), values, values)
        read += count
        packed = pack_window(carry, new, budgets, batch, final)
        for rows in packed.batches:
            if rows.shape[0] < batch and drop_last:
                break
            yield packed_batch(packed.plan, packed.items, rows, batch, budgets)
        if final:
            return
        carry = packed.carry
