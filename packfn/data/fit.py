"""Fitting documents into rows: the budgets, best fit (with the cap-balanced pass) and next fit.

Plain Python over document lengths; :mod:`packfn.data.packer` builds batches on it.

NOTE [Best fit under several budgets]
A row has three budgets: input columns (spans against ``sequence``),
aligned columns (against ``budget``) and document slots. A document of
``n`` tokens fits a row exactly when ``n <= min(aligned room, span room
rounded down to m)`` and a slot is free (both rooms are what is left of
budgets that are multiples of what the sizes round to), so that minimum is
one key per open row. Best fit keeps the keys in a sorted list of
``key << 32 | row`` integers: the tightest row that fits is one ``bisect``,
taking it one ``pop``, and a row leaves the list once it holds
``max_documents`` documents or has no room. That pass is the only
per-document Python; everything else, the tensors included, is a few
vectorized calls over flat arrays, so packing time does not grow with
``max_documents`` beyond allocating the ``[rows, max_documents]`` outputs.
When the cap binds, best fit alone leaves the short documents to rows that
run out of slots first: see NOTE [When the cap binds].
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable
from typing import NamedTuple

import torch

from packfn._checks import check_positive_int
from packfn._utils import cdiv, round_up
from packfn.data.batch import CLOSED_BUDGET, CLOSED_DOCUMENTS, CLOSED_END, CLOSED_TOKENS

STRATEGIES = ("best_fit", "next_fit")
"""The packing strategies: best-fit decreasing over a window (dense), next fit in input order."""

_SHIFT = 32  # a row key is room << _SHIFT | row
_BALANCE_ABOVE = 1.005  # the cap-balanced pass runs when best fit needs more rows than this times the bound
_ROW_MASK = (1 << _SHIFT) - 1


class Budgets(NamedTuple):
    sequence: int
    alignment: int
    max_documents: int
    budget: int
    multiple: int
    split: bool
    strategy: str

    @property
    def longest(self) -> int:
        """The longest document an empty row holds: its span fits ``sequence``, its aligned size ``budget``."""
        return min(self.budget, self.sequence // self.multiple * self.multiple)


def checked_budgets(
    sequence: object,
    alignment: object,
    max_documents: object,
    budget: object,
    multiple: object,
    split: object,
    strategy: object = "best_fit",
) -> Budgets:
    sequence = check_positive_int(sequence, "sequence")
    alignment = check_positive_int(alignment, "alignment")
    max_documents = check_positive_int(max_documents, "max_documents")
    multiple = check_positive_int(multiple, "pad_to_multiple_of")
    if budget is None:
        budget = round_up(sequence, alignment)
    budget = check_positive_int(budget, "budget")
    if budget % alignment:
        raise ValueError(f"budget={budget} must be a multiple of alignment={alignment}")
    if multiple > sequence:
        raise ValueError(f"pad_to_multiple_of={multiple} must not exceed sequence={sequence}: no document would fit")
    if not isinstance(split, bool):
        raise TypeError(f"split must be a bool, got {type(split).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
    return Budgets(sequence, alignment, max_documents, budget, multiple, split, strategy)


def _document_length(value: object, index: int) -> int:
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"document {index}: a length must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"document {index}: a length must be an int, got {type(value).__name__}") from None


def _past_int64(document: int, length: int) -> ValueError:
    return ValueError(f"document {document}: a length must fit in int64, got {length}")


def _int64_lengths(values: torch.Tensor, first: int) -> torch.Tensor:
    """``values`` as int64, raising for unsigned 64-bit lengths past int64 (they would turn negative)."""
    if values.dtype == torch.uint64 and values.numel() and bool((values.view(torch.int64) < 0).any()):
        index = int(torch.nonzero(values.view(torch.int64) < 0)[0, 0])
        raise _past_int64(first + index, int(values.view(torch.int64)[index]) + 2**64)
    return values.to(torch.int64)


def check_iterable(lengths: object) -> None:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise TypeError(f"lengths must be an iterable of ints, got {type(lengths).__name__}")


def lengths_tensor(lengths: object, first: int = 0) -> torch.Tensor:
    """int64 ``[documents]`` of positive lengths (``first``: the index of the first one, for messages)."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            kind = "a bool" if lengths.dtype == torch.bool else f"Tensor of dtype {lengths.dtype}"
            raise TypeError(f"document {first}: a length must be an int, got {kind}")
        if lengths.ndim > 1:
            raise ValueError(f"lengths must be 1-D (one length per document), got shape {tuple(lengths.shape)}")
        values = _int64_lengths(lengths.reshape(-1), first)
    elif hasattr(lengths, "__array_interface__") and getattr(lengths, "dtype", None) is not None:
        if lengths.dtype.kind not in "iu":  # a NumPy array
            raise TypeError(f"document {first}: a length must be an int, got an array of dtype {lengths.dtype}")
        if lengths.ndim > 1:
            raise ValueError(f"lengths must be 1-D (one length per document), got shape {tuple(lengths.shape)}")
        values = _int64_lengths(torch.as_tensor(lengths).reshape(-1), first)
    else:
        check_iterable(lengths)
        items = lengths if isinstance(lengths, (list, tuple)) else list(lengths)
        if not set(map(type, items)) <= {int}:  # the fast path: plain ints (set(map(...)) runs in C)
            items = [_document_length(value, first + index) for index, value in enumerate(items)]
        try:
            values = torch.tensor(items, dtype=torch.int64)
        except (OverflowError, RuntimeError, ValueError):
            index, value = next((index, value) for index, value in enumerate(items) if not -(2**63) <= value < 2**63)
            raise _past_int64(first + index, value) from None
    if values.numel() and bool((values < 1).any()):
        index = int(torch.nonzero(values < 1)[0, 0])
        raise ValueError(f"document {first + index}: lengths must be positive, got {int(values[index])}")
    return values


# ------------------------------------------------------------------ packing a window


class Items(NamedTuple):
    """What a window packs, as int64 ``[items]`` tensors: new documents, and the pieces carried in rows."""

    document: torch.Tensor
    offset: torch.Tensor  # first token of the document the item holds
    length: torch.Tensor
    total: torch.Tensor


class Plan(NamedTuple):
    """A window packed: pieces sorted by row then slot (int64 ``[pieces]``), and per-row facts (``[rows]``)."""

    rows: int
    row: torch.Tensor
    slot: torch.Tensor
    item: torch.Tensor  # the item the piece comes from
    offset: torch.Tensor  # first token of the document the piece holds
    length: torch.Tensor
    span: torch.Tensor
    column: torch.Tensor
    count: torch.Tensor  # pieces per row
    first: torch.Tensor  # index of each row's first piece
    closed: torch.Tensor  # CLOSED_BY codes
    fullness: torch.Tensor  # float: 1 for a row at the cap, else its fuller budget's fraction


def split_items(items: Items, budgets: Budgets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(item, offset, length)`` of each piece: items that do not fit an empty row cut into full rows and a rest."""
    count = items.length.shape[0]
    longest = budgets.longest
    long = items.length > longest
    if not bool(long.any()):
        return torch.arange(count), items.offset, items.length
    if not budgets.split:
        index = int(torch.nonzero(long)[0, 0])
        length = int(items.length[index])
        raise ValueError(
            f"document {int(items.document[index])} of {length} tokens does not fit an empty row: it takes "
            f"{round_up(length, budgets.multiple)} input columns (sequence={budgets.sequence}) and "
            f"{round_up(length, budgets.alignment)} aligned columns (budget={budgets.budget}); "
            "pass split=True to cut it into pieces"
        )
    pieces_per_item = torch.where(long, (items.length - 1) // longest + 1, 1)  # cdiv, without length + longest - 1
    item = torch.repeat_interleave(torch.arange(count), pieces_per_item)
    within = torch.arange(item.shape[0]) - (torch.cumsum(pieces_per_item, 0) - pieces_per_item).index_select(0, item)
    length = torch.clamp(items.length.index_select(0, item) - within * longest, max=longest)
    return item, items.offset.index_select(0, item) + within * longest, length


class _Rows(NamedTuple):
    """Open rows during a best-fit pass, as Python lists (one entry per row): room left in each budget, pieces held."""

    aligned: list[int]  # aligned columns left of budget
    spans: list[int]  # input columns left of sequence
    counts: list[int]

    def copy(self) -> _Rows:
        return _Rows(self.aligned.copy(), self.spans.copy(), self.counts.copy())


def _keys(rows: _Rows, multiple: int, cap: int) -> list[int]:
    """The sorted ``key << 32 | row`` of the rows that can take a document (NOTE [Best fit under several budgets])."""
    return sorted(
        (min(aligned, spans // multiple * multiple) << _SHIFT) | row
        for row, (aligned, spans, count) in enumerate(zip(*rows, strict=True))
        if count < cap and min(aligned, spans // multiple * multiple) > 0
    )


def _best_fit(lengths: list[int], aligned: list[int], spans: list[int], budgets: Budgets, rows: _Rows) -> list[int]:
    """Best fit, in the given order, into ``rows`` (extended with the rows it opens); the row of each piece.

    A row's key is the longest document it can take, ``min(aligned room,
    span room rounded down to the multiple)``: a document of ``n`` tokens
    fits exactly when ``n`` is at most that (both rooms are what is left of
    budgets that are multiples of what the sizes round to), so the tightest
    row that fits is one ``bisect`` away.
    """
    sequence, _, cap, budget, multiple = budgets[:5]
    keys = _keys(rows, multiple, cap)
    room_aligned, room_spans, counts = rows
    out: list[int] = []
    append, find, insert, take = out.append, bisect.bisect_left, bisect.insort, keys.pop
    for length, size, span in zip(lengths, aligned, spans, strict=True):
        index = find(keys, length << _SHIFT)
        if index < len(keys):
            row = take(index) & _ROW_MASK
            left, room, count = room_aligned[row] - size, room_spans[row] - span, counts[row] + 1
            room_aligned[row], room_spans[row], counts[row] = left, room, count
        else:
            row = len(counts)
            left, room, count = budget - size, sequence - span, 1
            room_aligned.append(left)
            room_spans.append(room)
            counts.append(1)
        append(row)
        if count < cap:
            if multiple != 1:
                room = room // multiple * multiple
            if room < left:
                left = room
            if left > 0:
                insert(keys, (left << _SHIFT) | row)
    return out


def _best_fit_one_budget(sizes: list[int], capacity: int, cap: int, rows: _Rows, key: int) -> list[int]:
    """:func:`_best_fit` when one budget implies the other: ``rows[key]`` is the room, ``sizes`` the sizes it counts.

    The same rows come out (the key of a row is that room, and a document
    fits exactly when its size is at most it); about a third less Python
    per document. The other room is left unchanged: callers recompute it.
    """
    rooms, counts = rows[key], rows.counts
    cap_applies = cap < capacity
    keys = sorted((room << _SHIFT) | row for row, room in enumerate(rooms) if room > 0 and counts[row] < cap)
    out: list[int] = []
    append, find, insert, take = out.append, bisect.bisect_left, bisect.insort, keys.pop
    for size in sizes:
        index = find(keys, size << _SHIFT)
        if index < len(keys):
            row = take(index) & _ROW_MASK
            room = rooms[row] - size
            rooms[row] = room
            if cap_applies:
                count = counts[row] + 1
                counts[row] = count
                if count >= cap:
                    append(row)
                    continue
        else:
            row = len(rooms)
            room = capacity - size
            rooms.append(room)
            counts.append(1)
            if cap_applies and cap <= 1:
                append(row)
                continue
        append(row)
        if room:
            insert(keys, (room << _SHIFT) | row)
    return out


def _fit(sizes: tuple[torch.Tensor, torch.Tensor, torch.Tensor], budgets: Budgets, rows: _Rows) -> torch.Tensor:
    """Best fit of pieces (lengths, aligned sizes, spans; in packing order) into ``rows``: the row of each."""
    sequence, alignment, cap, budget, multiple = budgets[:5]
    if alignment % multiple == 0 and budget <= sequence:
        placed = _best_fit_one_budget(sizes[1].tolist(), budget, cap, rows, 0)  # aligned sizes imply spans
    elif multiple % alignment == 0 and sequence <= budget:
        placed = _best_fit_one_budget(sizes[2].tolist(), sequence, cap, rows, 1)  # spans imply aligned sizes
    else:
        placed = _best_fit(*(size.tolist() for size in sizes), budgets, rows)
    return torch.tensor(placed, dtype=torch.int64).reshape(-1)


def _balanced(
    sizes: tuple[torch.Tensor, torch.Tensor, torch.Tensor], budgets: Budgets, start: _Rows
) -> tuple[torch.Tensor, int]:
    """The cap-balanced pass (NOTE [When the cap binds]): the row of each piece (sorted longest first), and the rows.

    ``sizes`` are the pieces' lengths, aligned sizes and spans, longest
    first; ``start`` the rows carried in (left unchanged).
    """
    sequence, _, cap, budget = budgets[:4]
    length, aligned, spans = sizes
    pieces, carried = length.shape[0], len(start.counts)
    used_aligned = torch.tensor([budget - room for room in start.aligned], dtype=torch.int64)
    used_spans = torch.tensor([sequence - room for room in start.spans], dtype=torch.int64)
    held = torch.tensor(start.counts, dtype=torch.int64)
    needed = max(
        cdiv(int(aligned.sum()) + int(used_aligned.sum()), budget),
        cdiv(int(spans.sum()) + int(used_spans.sum()), sequence),
        cdiv(pieces + int(held.sum()), cap),
        carried,
        1,
    )
    opened = torch.zeros(needed - carried, dtype=torch.int64)
    used_aligned, used_spans, held = (torch.cat([tensor, opened]) for tensor in (used_aligned, used_spans, held))
    # Deal in boustrophedon order, then keep each row's prefix that fits all three budgets.
    index = torch.arange(pieces)
    lap, at = index // needed, index % needed
    dealt = torch.where(lap % 2 == 1, needed - 1 - at, at)
    row, order = torch.sort(dealt, stable=True)
    count = torch.bincount(row, minlength=needed)
    first = (torch.cumsum(count, 0) - count).index_select(0, row)
    within = torch.arange(pieces) - first
    fits = within + 1 + held.index_select(0, row) <= cap
    for size, used, limit in ((aligned, used_aligned, budget), (spans, used_spans, sequence)):
        dealt_sizes = size.index_select(0, order)
        total = torch.cumsum(dealt_sizes, 0)
        fits &= total - (total - dealt_sizes).index_select(0, first) + used.index_select(0, row) <= limit
    placed = torch.full((pieces,), -1, dtype=torch.int64).index_copy_(0, order, torch.where(fits, row, -1))
    kept = torch.nonzero(placed >= 0).reshape(-1)
    into = placed.index_select(0, kept)
    used_aligned.index_add_(0, into, aligned.index_select(0, kept))
    used_spans.index_add_(0, into, spans.index_select(0, kept))
    held.index_add_(0, into, torch.ones_like(into))
    rows = _Rows((budget - used_aligned).tolist(), (sequence - used_spans).tolist(), held.tolist())
    rest = torch.nonzero(placed < 0).reshape(-1)
    if rest.numel():
        sizes = tuple(values.index_select(0, rest) for values in (length, aligned, spans))
        placed.index_copy_(0, rest, _fit(sizes, budgets, rows))
    return placed, len(rows.counts)


# NOTE [No advanced indexing on the packing path]
# The packer and the loader gather and scatter with index_select, index_copy_,
# index_add_ and gather, never with tensor[index] / tensor[index] = values
# (aten::index, index_put_, take). On the CPU those split even a few
# thousand elements across intra-op threads, and with the other core busy
# (a data-loader worker beside a training step, or a shared machine) each
# call waits for a thread to be scheduled: 12 ms instead of 15 us for 5,000
# elements on a 2-core VM with torch 2.13 and 2 threads. The named ops run
# on the calling thread at these sizes.


# NOTE [When the cap binds]
# Best fit decreasing packs the long documents first and tightly, so the
# short ones are left to the last rows, which then fill their document
# slots long before their columns (exponential lengths of mean 300 in rows
# of 4096 under max_documents=16: 27% more rows than the token bound). So
# when a best-fit pass needs over 0.5% more rows than the bound (the most
# of the aligned, span and document bounds) and closed a row at the cap
# while it still had room for the window's shortest piece, a second pass
# deals the pieces, longest first, over as many rows as that bound in
# boustrophedon order (0, 1, ..., R - 1, R - 1, ..., 0, ...), so each row
# gets long and short pieces alike and about the same count, keeps each
# row's prefix that fits its budgets and best-fits the rest. The pass with
# fewer rows wins (best fit on a tie).


def best_fit_rows(piece_length: torch.Tensor, carried_row: torch.Tensor, budgets: Budgets) -> tuple[torch.Tensor, int]:
    """The row of every piece under best fit decreasing (carried pieces keep their rows first), and the row count."""
    sequence, alignment, cap, budget, multiple = budgets[:5]
    carried = carried_row.shape[0]
    spans = round_up(piece_length, multiple)
    aligned = round_up(piece_length, alignment)
    carried_rows = int(carried_row.max()) + 1 if carried else 0
    used_aligned = torch.zeros(carried_rows, dtype=torch.int64).index_add_(0, carried_row, aligned[:carried])
    used_spans = torch.zeros(carried_rows, dtype=torch.int64).index_add_(0, carried_row, spans[:carried])
    start = _Rows(
        (budget - used_aligned).tolist(),
        (sequence - used_spans).tolist(),
        torch.bincount(carried_row, minlength=carried_rows).tolist(),
    )
    order = torch.sort(piece_length[carried:], descending=True, stable=True).indices
    sizes = tuple(values[carried:].index_select(0, order) for values in (piece_length, aligned, spans))
    rows = start.copy()
    placed = _fit(sizes, budgets, rows)
    count = len(rows.counts)
    if sizes[0].numel() and cap < sequence:
        # The fewest rows any packing needs: the aligned, span and document bounds.
        pieces = piece_length.shape[0]
        bound = max(cdiv(int(aligned.sum()), budget), cdiv(int(spans.sum()), sequence), cdiv(pieces, cap))
        if count > bound * _BALANCE_ABOVE:
            # Did the cap close a row that had room for the window's shortest piece?
            row = torch.cat([carried_row, placed])
            held = torch.bincount(row, minlength=count)
            used = torch.zeros(count, dtype=torch.int64).index_add_(0, row, torch.cat([aligned[:carried], sizes[1]]))
            taken = torch.zeros(count, dtype=torch.int64).index_add_(0, row, torch.cat([spans[:carried], sizes[2]]))
            room = torch.minimum(budget - used, (sequence - taken) // multiple * multiple)
            if bool(((held >= cap) & (room >= sizes[0][-1])).any()):
                balanced, balanced_count = _balanced(sizes, budgets, start)
                if balanced_count < count:
                    placed, count = balanced, balanced_count
    row = torch.empty_like(piece_length)
    row[:carried] = carried_row
    row[carried:].index_copy_(0, order, placed)
    return row, count


def next_fit_rows(
    items: Items, carried_row: torch.Tensor, budgets: Budgets
) -> tuple[list[int], list[int], list[int], list[int], list[int], int]:
    """Next fit in input order: ``(item, offset, length, row)`` per piece, the closing code per row, the row count.

    Carried pieces keep their rows; the last carried row is still open.
    """
    sequence, alignment, cap, budget, multiple, split, _ = budgets
    carried = carried_row.shape[0]
    piece_item = list(range(carried))
    piece_offset = items.offset[:carried].tolist()
    piece_length = items.length[:carried].tolist()
    piece_row = carried_row.tolist()
    rows = piece_row[-1] + 1 if carried else 0
    closed = [CLOSED_END] * rows
    if carried:
        row = rows - 1
        last = [length for length, at in zip(piece_length, piece_row, strict=True) if at == row]
        count, used_span = len(last), sum(round_up(n, multiple) for n in last)
        used_aligned = sum(round_up(n, alignment) for n in last)
    else:
        row, count, used_span, used_aligned = -1, cap, 0, 0  # no open row: the first document opens one
    for item, (offset, length) in enumerate(
        zip(items.offset[carried:].tolist(), items.length[carried:].tolist(), strict=True), start=carried
    ):
        span, aligned = round_up(length, multiple), round_up(length, alignment)
        if span <= sequence and aligned <= budget:  # fits an empty row: never split
            if count == cap or used_span + span > sequence or used_aligned + aligned > budget:
                if row >= 0:
                    closed[row] = (
                        CLOSED_TOKENS
                        if used_span + span > sequence
                        else CLOSED_DOCUMENTS
                        if count == cap
                        else CLOSED_BUDGET
                    )
                row, count, used_span, used_aligned = row + 1, 0, 0, 0
                closed.append(CLOSED_END)
            pieces = ((offset, length),)
        elif not split:
            raise ValueError(
                f"document {int(items.document[item])} of {length} tokens does not fit an empty row: it takes "
                f"{span} input columns (sequence={sequence}) and {aligned} aligned columns (budget={budget}); "
                "pass split=True to cut it into pieces"
            )
        else:
            pieces = ()
        start, end = offset, offset + length
        while pieces or start < end:
            if pieces:
                piece_offset_, piece = pieces[0]
                pieces = ()
            else:
                # The longest piece the row has room for: its aligned size within
                # the budget (a multiple of alignment), its span within the row.
                room = min(budget - used_aligned, (sequence - used_span) // multiple * multiple)
                if count == cap or room < 1:
                    if row >= 0:
                        closed[row] = (
                            CLOSED_TOKENS
                            if used_span >= sequence
                            else CLOSED_DOCUMENTS
                            if count == cap
                            else CLOSED_BUDGET
                        )
                    row, count, used_span, used_aligned = row + 1, 0, 0, 0
                    closed.append(CLOSED_END)
                    continue
                piece_offset_, piece = start, min(room, end - start)
            piece_item.append(item)
            piece_offset.append(piece_offset_)
            piece_length.append(piece)
            piece_row.append(row)
            count += 1
            used_span += round_up(piece, multiple)
            used_aligned += round_up(piece, alignment)
            start = piece_offset_ + piece
    return piece_item, piece_offset, piece_length, piece_row, closed, max(row + 1, rows)
