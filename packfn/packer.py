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
of lengths. :mod:`packfn.data` is a loader over tokenized examples built on it.

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
import itertools
import operator
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, reduce
from typing import NamedTuple

import torch

from packfn._checks import check_bool, check_positive_int
from packfn._deprecated import deprecated
from packfn._utils import cdiv, round_up

__all__ = [
    "CLOSED_BY",
    "STRATEGIES",
    "BudgetSuggestion",
    "PackedBatch",
    "Piece",
    "Pieces",
    "pack_documents",
    "pack_stream",
    "suggest_budgets",
]

STRATEGIES = ("best_fit", "next_fit")
"""The packing strategies: best-fit decreasing over a window (dense), next fit in input order."""

CLOSED_BY = ("tokens", "budget", "documents", "end")
"""What closed a row (:attr:`PackedBatch.closed_by`), by code.

- ``"tokens"``: its input columns cannot take one more document (the
  smallest of its window for best fit, the next one for next fit);
- ``"budget"``: its input columns could, its aligned columns cannot: a
  larger ``budget`` would let it take more;
- ``"documents"``: it holds ``max_documents`` documents: a larger cap would
  let it take more (a length distribution this row cannot fill under the cap);
- ``"end"``: it had room, but the list or the stream's window ran out of
  documents (the last rows).
"""
_TOKENS, _BUDGET, _DOCUMENTS, _END = range(4)

_SHIFT = 32  # a row key is room << _SHIFT | row
_BALANCE_ABOVE = 1.005  # the cap-balanced pass runs when best fit needs more rows than this times the bound
_ROW_MASK = (1 << _SHIFT) - 1


class Piece(NamedTuple):
    """One document (or one piece of a split document) in a packed row.

    Attributes:
        document: Index of the document in the input (its position in the
            list or stream of lengths).
        offset: First token of the document this piece holds (0 unless the
            document was split).
        length: Real tokens of the piece.
        span: Input columns it takes: ``length`` rounded up to
            ``pad_to_multiple_of``.
        column: Its first input column in the row.
    """

    document: int
    offset: int
    length: int
    span: int
    column: int


class Pieces(NamedTuple):
    """Every piece of a batch as flat int64 ``[pieces]`` tensors, row by row, slot by slot.

    Attributes:
        row, slot: Where the piece sits (document id ``slot + 1`` of ``row``).
        document, offset, length, span, column: As in :class:`Piece`.
        total: Full length of the piece's document.
    """

    row: torch.Tensor
    slot: torch.Tensor
    document: torch.Tensor
    offset: torch.Tensor
    length: torch.Tensor
    span: torch.Tensor
    column: torch.Tensor
    total: torch.Tensor


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """A packed batch: which document goes where, and the tensors the model takes.

    Attributes:
        document_ids: int64 ``[batch, sequence]``: the 1-based slot of each
            real token's piece, 0 at padding (span padding and the rest of
            the row). The packing format of :func:`packfn.varlen_metadata`.
        seq_lens: int64 ``[batch, max_documents]``: real lengths per slot,
            0 for absent slots.
        seq_lens_padded: int64 ``[batch, max_documents]``: physical spans
            per slot (equal to ``seq_lens`` when ``pad_to_multiple_of`` is 1),
            0 for absent slots.
        sequence: Input row length.
        alignment: Alignment of document starts in the aligned rows.
        budget: Aligned row length: pass it as ``budget`` of
            :func:`packfn.aligned_layout` (a multiple of ``alignment``).
        max_documents: Document slots per row: pass it as ``max_documents``
            of the metadata ops.
        pieces: Every piece, as flat tensors (:class:`Pieces`).
        closed_by: Per row, what closed it: one of :data:`CLOSED_BY`
            (``"end"`` for an all-padding row).
        num_tokens: Real tokens in the batch.
    """

    document_ids: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_padded: torch.Tensor
    sequence: int
    alignment: int
    budget: int
    max_documents: int
    pieces: Pieces
    closed_by: tuple[str, ...]
    num_tokens: int

    @property
    def batch(self) -> int:
        """Rows in the batch."""
        return self.document_ids.shape[0]

    @cached_property
    def rows(self) -> tuple[tuple[Piece, ...], ...]:
        """One tuple of :class:`Piece` per row, in order (slot ``k`` is id ``k + 1``); empty for padding rows."""
        pieces = self.pieces
        counts = torch.bincount(pieces.row, minlength=self.batch).tolist()
        flat = [
            Piece(*values)
            for values in zip(
                *(
                    field.tolist()
                    for field in (pieces.document, pieces.offset, pieces.length, pieces.span, pieces.column)
                ),
                strict=True,
            )
        ]
        bounds = list(itertools.accumulate(counts, initial=0))
        return tuple(tuple(flat[begin:end]) for begin, end in itertools.pairwise(bounds))

    @cached_property
    def document_lengths(self) -> Mapping[int, int]:
        """Full length of every document that has a piece in this batch, by document index."""
        return dict(zip(self.pieces.document.tolist(), self.pieces.total.tolist(), strict=True))

    @property
    def fill_ratio(self) -> float:
        """Real tokens over the aligned area ``batch * budget`` (what attention and the packed rows cover)."""
        return self.num_tokens / (self.batch * self.budget)

    @property
    def fill(self) -> float:
        """Deprecated spelling of :attr:`fill_ratio`."""
        deprecated("PackedBatch.fill is deprecated; use PackedBatch.fill_ratio")
        return self.fill_ratio

    def limits(self) -> Counter[str]:
        """How many rows each constraint closed (the counts of :attr:`closed_by`, padding rows left out)."""
        present = torch.bincount(self.pieces.row, minlength=self.batch).tolist()
        return Counter(reason for reason, count in zip(self.closed_by, present, strict=True) if count)

    def gather(
        self,
        documents: Sequence | Mapping,
        *,
        padding: int | float = 0,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Lay the documents' tokens out in the packed rows.

        Args:
            documents: The tokens of each document, indexable by document
                index (a list for :func:`pack_documents`, a list or a
                ``{index: tokens}`` mapping over the stream for
                :func:`pack_stream`); each a 1-D tensor or a list of its
                ``n`` token ids (or any per-token values: labels, loss
                weights, ...).
            padding: Value written at padding columns.
            dtype: dtype of the result; by default the documents' dtypes
                promoted together (a tensor's own, int64 for a list of
                ints, float32 for a list of floats).

        Returns:
            ``dtype`` ``[batch, sequence]``: each piece's tokens at its
            columns, ``padding`` elsewhere. In the example of
            :func:`pack_documents`, ``gather([[1, 2, 3, 4], ...])[0, :4]``
            is ``[1, 2, 3, 4]`` (document 0 opens row 0).

        Raises:
            ValueError: ``documents`` has no entry for a packed document, a
                document's token count is not the length it was packed
                with, its tokens are not 1-D, or it holds values ``dtype``
                cannot hold (floating values an integral ``dtype`` would
                truncate, integers outside its range).
        """
        pieces = self.pieces
        slices = []
        for document, offset, length, total in zip(
            pieces.document.tolist(), pieces.offset.tolist(), pieces.length.tolist(), pieces.total.tolist(), strict=True
        ):
            try:
                values = torch.as_tensor(documents[document])
            except (KeyError, IndexError):
                raise ValueError(f"documents has no entry for document {document}, which this batch packs") from None
            if values.ndim != 1 or values.shape[0] != total:
                raise ValueError(
                    f"document {document} was packed with {total} tokens, got tokens of shape {tuple(values.shape)}"
                )
            slices.append((document, values[offset : offset + length]))
        if dtype is None:
            dtype = reduce(torch.promote_types, [values.dtype for _, values in slices]) if slices else torch.int64
        for document, values in slices:
            _check_holds(values, dtype, document)
        out = torch.full((self.batch * self.sequence,), padding, dtype=dtype)
        if slices:
            out.index_copy_(
                0,
                token_positions(pieces.row * self.sequence + pieces.column, pieces.length),
                torch.cat([values.to(dtype) for _, values in slices]),
            )
        return out.view(self.batch, self.sequence)


def token_positions(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 ``[sum(lengths)]``: ``starts[k], ..., starts[k] + lengths[k] - 1`` for each ``k`` in turn."""
    total = int(lengths.sum())
    ends = torch.cumsum(lengths, 0)
    shift = torch.repeat_interleave(starts - (ends - lengths), lengths, output_size=total)
    return torch.arange(total, dtype=torch.int64) + shift


# ------------------------------------------------------------------ checks


def _check_holds(values: torch.Tensor, dtype: torch.dtype, document: int) -> None:
    """Raise ``ValueError`` where ``values`` would not survive a cast to ``dtype`` (truncated, or wrapped)."""
    if dtype.is_floating_point or dtype.is_complex:
        return
    if values.is_floating_point() or values.is_complex():
        raise ValueError(
            f"document {document} holds {values.dtype} values, which gather(dtype={dtype}) would truncate; "
            "pass a floating dtype"
        )
    if values.numel() and values.dtype != dtype:
        info = torch.iinfo(dtype) if dtype != torch.bool else None
        low, high = (0, 1) if info is None else (info.min, info.max)
        if int(values.min()) < low or int(values.max()) > high:
            raise ValueError(f"document {document} holds values outside [{low}, {high}], which {dtype} cannot hold")


class _Budgets(NamedTuple):
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


def _budgets(
    sequence: object,
    alignment: object,
    max_documents: object,
    budget: object,
    multiple: object,
    split: object,
    strategy: object = "best_fit",
) -> _Budgets:
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
    return _Budgets(sequence, alignment, max_documents, budget, multiple, split, strategy)


def _document_length(value: object, index: int) -> int:
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"document {index}: a length must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"document {index}: a length must be an int, got {type(value).__name__}") from None


def _check_iterable(lengths: object) -> None:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise TypeError(f"lengths must be an iterable of ints, got {type(lengths).__name__}")


def _lengths_tensor(lengths: object, first: int = 0) -> torch.Tensor:
    """int64 ``[documents]`` of positive lengths (``first``: the index of the first one, for messages)."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            kind = "a bool" if lengths.dtype == torch.bool else f"Tensor of dtype {lengths.dtype}"
            raise TypeError(f"document {first}: a length must be an int, got {kind}")
        if lengths.ndim > 1:
            raise ValueError(f"lengths must be 1-D (one length per document), got shape {tuple(lengths.shape)}")
        values = lengths.reshape(-1).to(torch.int64)
    elif hasattr(lengths, "__array_interface__") and getattr(lengths, "dtype", None) is not None:
        if lengths.dtype.kind not in "iu":  # a NumPy array
            raise TypeError(f"document {first}: a length must be an int, got an array of dtype {lengths.dtype}")
        if lengths.ndim > 1:
            raise ValueError(f"lengths must be 1-D (one length per document), got shape {tuple(lengths.shape)}")
        values = torch.as_tensor(lengths).reshape(-1).to(torch.int64)
    else:
        _check_iterable(lengths)
        items = lengths if isinstance(lengths, (list, tuple)) else list(lengths)
        if not set(map(type, items)) <= {int}:  # the fast path: plain ints (set(map(...)) runs in C)
            items = [_document_length(value, first + index) for index, value in enumerate(items)]
        values = torch.tensor(items, dtype=torch.int64)
    if values.numel() and bool((values < 1).any()):
        index = int(torch.nonzero(values < 1)[0, 0])
        raise ValueError(f"document {first + index}: lengths must be positive, got {int(values[index])}")
    return values


# ------------------------------------------------------------------ packing a window


class _Items(NamedTuple):
    """What a window packs, as int64 ``[items]`` tensors: new documents, and the pieces carried in rows."""

    document: torch.Tensor
    offset: torch.Tensor  # first token of the document the item holds
    length: torch.Tensor
    total: torch.Tensor


class _Plan(NamedTuple):
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


def _split_items(items: _Items, budgets: _Budgets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    pieces_per_item = torch.where(long, cdiv(items.length, longest), 1)
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


def _best_fit(lengths: list[int], aligned: list[int], spans: list[int], budgets: _Budgets, rows: _Rows) -> list[int]:
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


def _fit(sizes: tuple[torch.Tensor, torch.Tensor, torch.Tensor], budgets: _Budgets, rows: _Rows) -> torch.Tensor:
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
    sizes: tuple[torch.Tensor, torch.Tensor, torch.Tensor], budgets: _Budgets, start: _Rows
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


def _best_fit_rows(
    piece_length: torch.Tensor, carried_row: torch.Tensor, budgets: _Budgets
) -> tuple[torch.Tensor, int]:
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


def _next_fit_rows(
    items: _Items, carried_row: torch.Tensor, budgets: _Budgets
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
    closed = [_END] * rows
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
                    closed[row] = _TOKENS if used_span + span > sequence else _DOCUMENTS if count == cap else _BUDGET
                row, count, used_span, used_aligned = row + 1, 0, 0, 0
                closed.append(_END)
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
                        closed[row] = _TOKENS if used_span >= sequence else _DOCUMENTS if count == cap else _BUDGET
                    row, count, used_span, used_aligned = row + 1, 0, 0, 0
                    closed.append(_END)
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


def _plan(items: _Items, carried_row: torch.Tensor, budgets: _Budgets) -> _Plan:
    """Pack a window: its carried pieces (the first ``len(carried_row)`` items, in their rows) and new documents."""
    sequence, alignment, cap, budget, multiple = budgets[:5]
    if budgets.strategy == "best_fit":
        carried = carried_row.shape[0]
        item, offset, length = _split_items(_Items(*(field[carried:] for field in items)), budgets)
        item = torch.cat([torch.arange(carried), item + carried])
        offset = torch.cat([items.offset[:carried], offset])
        length = torch.cat([items.length[:carried], length])
        row, rows = _best_fit_rows(length, carried_row, budgets)
        closed = None
    else:
        item, offset, length, row, closed, rows = (
            torch.tensor(values, dtype=torch.int64) if isinstance(values, list) else values
            for values in _next_fit_rows(items, carried_row, budgets)
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
            _TOKENS,
            torch.where(
                at_cap,
                _DOCUMENTS,
                torch.where(used_aligned + round_up(smallest, alignment) > budget, _BUDGET, _END),
            ),
        )
    else:
        closed = closed[:rows]
    fullness = torch.where(at_cap, 1.0, torch.maximum(used_span / sequence, used_aligned / budget))
    return _Plan(
        rows, row, slot, item, offset, length, span, column, count, first.sort().values[:rows], closed, fullness
    )


def _batch(plan: _Plan, items: _Items, selected: torch.Tensor | None, batch: int, budgets: _Budgets) -> PackedBatch:
    """The :class:`PackedBatch` of ``selected`` rows of a plan (all, in order, when None), padded to ``batch`` rows."""
    return _batch_and_items(plan, items, selected, batch, budgets)[0]


def _batch_and_items(
    plan: _Plan, items: _Items, selected: torch.Tensor | None, batch: int, budgets: _Budgets
) -> tuple[PackedBatch, torch.Tensor]:
    """:func:`_batch`, and the item each of its pieces comes from (int64 ``[pieces]``)."""
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
    codes = torch.full((batch,), _END, dtype=torch.int64)
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


def document_ids(
    row: torch.Tensor, slot: torch.Tensor, column: torch.Tensor, length: torch.Tensor, batch: int, sequence: int
) -> torch.Tensor:
    """int64 ``[batch, sequence]``: ``slot + 1`` over each piece's real tokens, 0 elsewhere.

    One pass over the output: each piece adds its id at its first column and
    takes it back after its last one, and a cumulative sum spreads them.
    """
    flat = torch.zeros(batch * sequence + 1, dtype=torch.int64)
    start = row * sequence + column
    flat.index_add_(0, start, slot + 1)
    flat.index_add_(0, start + length, -(slot + 1))
    torch.cumsum(flat, 0, out=flat)
    return flat[:-1].view(batch, sequence)


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
        ValueError: a length below 1; a budget that is not a multiple of
            ``alignment``; ``pad_to_multiple_of > sequence``; an unknown
            strategy; a document that does not fit an empty row without
            ``split``; documents that need more than ``batch`` rows; no
            document with ``batch`` unset.

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
    budgets = _budgets(sequence, alignment, max_documents, budget, pad_to_multiple_of, split, strategy)
    if batch is not None:
        batch = check_positive_int(batch, "batch")
    values = _lengths_tensor(lengths)
    count = values.shape[0]
    items = _Items(torch.arange(count), torch.zeros(count, dtype=torch.int64), values, values)
    plan = _plan(items, torch.zeros(0, dtype=torch.int64), budgets)
    if batch is None:
        if not plan.rows:
            raise ValueError("no document to pack: pass batch=... for a batch of empty rows")
        batch = plan.rows
    elif plan.rows > batch:
        raise ValueError(f"the documents need {plan.rows} rows, more than batch={batch}")
    return _batch(plan, items, None, batch, budgets)


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
    budgets = _budgets(sequence, alignment, max_documents, budget, pad_to_multiple_of, split, strategy)
    batch = check_positive_int(batch, "batch")
    window = check_positive_int(window, "window")
    drop_last = check_bool(drop_last, "drop_last")
    _check_iterable(lengths)
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


class _Carry(NamedTuple):
    """Rows carried between windows: their pieces (as items, row by row) and how many windows each was carried."""

    items: _Items
    row: torch.Tensor  # row of each carried piece, 0 .. rows - 1, nondecreasing
    age: torch.Tensor  # per carried row

    @staticmethod
    def empty() -> _Carry:
        none = torch.zeros(0, dtype=torch.int64)
        return _Carry(_Items(none, none, none, none), none, none)


class _Window(NamedTuple):
    """A packed window: the plan, its items (carried pieces first), the rows of each batch that leaves, the carry."""

    plan: _Plan
    items: _Items
    batches: list[torch.Tensor]
    carried_pieces: torch.Tensor  # indices into the plan's pieces, carried row by row
    carry: _Carry


def _pack_window(carry: _Carry, new: _Items, budgets: _Budgets, batch: int, final: bool) -> _Window:
    """Pack one window (NOTE [Windows and carried rows])."""
    items = _Items(*(torch.cat([old, added]) for old, added in zip(carry.items, new, strict=True)))
    plan = _plan(items, carry.row, budgets)
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
    carried_items = _Items(
        items.document.index_select(0, item),
        plan.offset.index_select(0, pieces),
        plan.length.index_select(0, pieces),
        items.total.index_select(0, item),
    )
    carry = _Carry(carried_items, new_row.index_select(0, pieces), age.index_select(0, kept))
    return _Window(plan, items, batches, pieces, carry)


def _stream(lengths: Iterator, batch: int, budgets: _Budgets, drop_last: bool, window: int) -> Iterator[PackedBatch]:
    carry, read = _Carry.empty(), 0
    while True:
        chunk = list(itertools.islice(lengths, window))
        final = len(chunk) < window  # a full window that happens to end the stream leaves its rows one window later
        values = _lengths_tensor(chunk, first=read)
        count = values.shape[0]
        new = _Items(torch.arange(read, read + count), torch.zeros(count, dtype=torch.int64), values, values)
        read += count
        packed = _pack_window(carry, new, budgets, batch, final)
        for rows in packed.batches:
            if rows.shape[0] < batch and drop_last:
                break
            yield _batch(packed.plan, packed.items, rows, batch, budgets)
        if final:
            return
        carry = packed.carry


# ------------------------------------------------------------------ choosing the budgets


class BudgetSuggestion(NamedTuple):
    """Budgets proposed by :func:`suggest_budgets` for a length distribution, and what they cost.

    Attributes:
        budget: Aligned row length to pass to the packer and to
            :func:`packfn.aligned_layout`.
        max_documents: Document cap to pass to the packer and the metadata ops.
        rows: Rows the sample packs into under both.
        fill: Real tokens over the input rows, ``tokens / (rows * sequence)``.
        fill_ratio: Real tokens over the aligned rows, ``tokens / (rows * budget)``.
        unlimited_rows: Rows with no cap and no aligned budget (only the input
            row's columns: the best any budgets can do, up to the packer).
        lower_bound_rows: ``ceil(tokens / sequence)``.
        most_documents: The most documents a row holds with no cap.
    """

    budget: int
    max_documents: int
    rows: int
    fill: float
    fill_ratio: float
    unlimited_rows: int
    lower_bound_rows: int
    most_documents: int


def suggest_budgets(
    lengths: Iterable[int],
    *,
    sequence: int,
    alignment: int = 1,
    pad_to_multiple_of: int = 1,
    tolerance: float = 0.01,
) -> BudgetSuggestion:
    """Propose a ``budget`` and the smallest ``max_documents`` that costs under ``tolerance`` of the fill.

    A cap too small for the length distribution silently collapses fill (at
    ``max_documents=16``, rows of 8192 columns hold about 1,500 tokens of
    documents averaging 96); a budget no wider than the row loses what
    alignment rounds away. This packs a sample of lengths (best fit,
    ``split=True``) a few times over:

    1. the budget: of the multiples of ``alignment`` from
       ``round_up(sequence, alignment)`` to twice that (17 of them at most,
       evenly spaced), the one whose rows carry the most real tokens per
       aligned column, ``tokens / (rows * budget)``, with no cap (the
       narrowest on a tie): a wider budget holds more documents per row but
       makes every row, and its attention, wider;
    2. the cap: under that budget, the smallest cap (by bisection) whose rows
       are at most ``rows(no cap) / (1 - tolerance)``.

    Args:
        lengths: A sample of document lengths (a few thousand are plenty;
            each pass is a pack of the whole sample).
        sequence: Input row length.
        alignment: Alignment of document starts in the aligned rows.
        pad_to_multiple_of: Physical span multiple (as the packer's).
        tolerance: Fraction of fill the cap may cost, in ``[0, 1)``.

    Returns:
        :class:`BudgetSuggestion`. Example: for 20,000 exponential lengths of
        mean 96 at ``sequence=8192, alignment=1``, ``max_documents=87``
        (rows hold 85 documents on average; under 16 they hold 1,500 tokens).

    Raises:
        TypeError, ValueError: as :func:`pack_documents`; a ``tolerance``
            outside ``[0, 1)``; an empty sample.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a number in [0, 1), got {tolerance!r}")
    sequence = check_positive_int(sequence, "sequence")
    alignment = check_positive_int(alignment, "alignment")
    multiple = check_positive_int(pad_to_multiple_of, "pad_to_multiple_of")
    values = _lengths_tensor(lengths)
    if not values.numel():
        raise ValueError("suggest_budgets needs at least one length")
    count = values.shape[0]
    items = _Items(torch.arange(count), torch.zeros(count, dtype=torch.int64), values, values)
    no_carry = torch.zeros(0, dtype=torch.int64)
    most = max(1, sequence // multiple)  # a row never holds more documents (each takes a span of at least one multiple)
    tokens = int(values.sum())

    def rows(budget: int, cap: int) -> _Plan:
        return _plan(items, no_carry, _budgets(sequence, alignment, cap, budget, multiple, True))

    narrowest = cdiv(sequence, alignment)  # in blocks of alignment columns
    step = max(1, cdiv(narrowest, 16))
    candidates = range(narrowest, 2 * narrowest + 1, step)
    plans = {blocks * alignment: rows(blocks * alignment, most) for blocks in candidates}
    budget = max(plans, key=lambda width: (tokens / (plans[width].rows * width), -width))
    uncapped = plans[budget]
    widest = round_up(sequence, alignment) + most * (alignment - 1) // alignment * alignment
    unlimited = rows(widest, most).rows  # only the input columns bind
    most_documents = int(uncapped.count.max())
    low, high = 1, most_documents
    while low < high:
        middle = (low + high) // 2
        if rows(budget, middle).rows <= uncapped.rows / (1 - tolerance):
            high = middle
        else:
            low = middle + 1
    chosen = rows(budget, low).rows
    return BudgetSuggestion(
        budget=budget,
        max_documents=low,
        rows=chosen,
        fill=tokens / (chosen * sequence),
        fill_ratio=tokens / (chosen * budget),
        unlimited_rows=unlimited,
        lower_bound_rows=cdiv(tokens, sequence),
        most_documents=most_documents,
    )
