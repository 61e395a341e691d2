"""Alignment-aware packing of documents into rows of fixed budgets (the data-loader side).

The static ops take fixed budgets: ``varlen_metadata(..., max_documents=D)``
holds at most ``D`` documents per row, and ``aligned_layout(..., budget=L)``
holds a row whose documents, each rounded up to ``alignment`` columns, take
at most ``L`` columns. :func:`packfn.safe_budget` gives the ``L``
that fits *any* row of ``sequence`` tokens and ``D`` documents, which is up
to ``D * (alignment - 1)`` columns wider than the tokens (752 columns for
512 tokens, 16 documents, alignment 16): attention then covers that much
more area. A packer that counts each document at its aligned size while it
fills rows guarantees a tighter ``L`` (by default the input row length
itself), so the static budgets cost no extra area.

This module is that packer. It is plain Python over document lengths, for a
data loader's worker (no op, no graph): :func:`pack_documents` packs a list,
:func:`pack_stream` turns a stream into batches of a fixed number of rows.

Rules (``a = alignment``, ``m = pad_to_multiple_of``):

- A row holds documents back to back, in stream order: a document of ``n``
  real tokens takes ``round_up(n, m)`` input columns (its physical span:
  ``n`` tokens, then ``span - n`` padding columns) and ``round_up(n, a)``
  aligned columns. A row takes documents while their spans fit
  ``sequence``, their aligned sizes fit ``budget`` and there are at most
  ``max_documents`` of them; the first document that does not fit starts
  the next row (next fit: order is kept, across rows too).
- A document that does not fit even an empty row raises ``ValueError``,
  unless ``split=True``: then it is cut into pieces, each as long as the
  row it lands in allows (the first piece fills what its row has left, the
  pieces in between fill whole rows, the last one shares its row with the
  documents that follow). Each piece is a document of its own for the
  metadata and for attention. Documents that fit an empty row are never
  split.

Every batch satisfies, with no assert tripping::

    packfn.varlen_metadata(batch.document_ids, max_documents=max_documents)
    packfn.aligned_layout(batch.seq_lens, batch.seq_lens_padded,
                          sequence_length=sequence, alignment=alignment, budget=budget)

and ``batch_metadata(document_ids, max_documents=...)`` recovers ``seq_lens``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from packfn._checks import check_positive_int
from packfn._deprecated import deprecated
from packfn._utils import round_up

__all__ = ["PackedBatch", "Piece", "pack_documents", "pack_stream"]


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


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """A packed batch: which document goes where, and the tensors the model takes.

    Attributes:
        rows: One tuple of :class:`Piece` per row, in order (slot ``k`` of a
            row is document id ``k + 1``); empty for an all-padding row.
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
        budget: Aligned row length: pass it as ``length`` of
            :func:`packfn.aligned_layout` (a multiple of ``alignment``).
        max_documents: Document slots per row: pass it as ``max_documents``
            of the metadata ops.
        document_lengths: Full length of every document that has a piece in
            this batch, by document index (:meth:`gather` checks against it).
    """

    rows: tuple[tuple[Piece, ...], ...]
    document_ids: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_padded: torch.Tensor
    sequence: int
    alignment: int
    budget: int
    max_documents: int
    document_lengths: Mapping[int, int]

    @property
    def batch(self) -> int:
        """Rows in the batch."""
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        """Real tokens in the batch."""
        return sum(piece.length for row in self.rows for piece in row)

    @property
    def fill_ratio(self) -> float:
        """Real tokens over the aligned area ``batch * budget`` (what attention and the packed rows cover)."""
        return self.num_tokens / (self.batch * self.budget)

    @property
    def fill(self) -> float:
        """Deprecated spelling of :attr:`fill_ratio`."""
        deprecated("PackedBatch.fill is deprecated; use PackedBatch.fill_ratio")
        return self.fill_ratio

    def gather(
        self,
        documents: Sequence | Mapping,
        *,
        padding: int = 0,
        dtype: torch.dtype = torch.int64,
    ) -> torch.Tensor:
        """Lay the documents' tokens out in the packed rows.

        Args:
            documents: The tokens of each document, indexable by document
                index (a list for :func:`pack_documents`, a list or a
                ``{index: tokens}`` mapping over the stream for
                :func:`pack_stream`); each a 1-D tensor or a list of its
                ``n`` token ids (or any per-token values: labels, ...).
            padding: Value written at padding columns.
            dtype: dtype of the result.

        Returns:
            ``dtype`` ``[batch, sequence]``: each piece's tokens at its
            columns, ``padding`` elsewhere. In the module example,
            ``gather([[1, 2, 3, 4, 5], ...])[0, :5]`` is ``[1, 2, 3, 4, 5]``.

        Raises:
            ValueError: a document's token count is not the length it was
                packed with, or its tokens are not 1-D.
        """
        out = torch.full((self.batch, self.sequence), padding, dtype=dtype)
        for row, pieces in enumerate(self.rows):
            for piece in pieces:
                tokens = torch.as_tensor(documents[piece.document], dtype=dtype)
                expected = self.document_lengths[piece.document]
                if tokens.ndim != 1 or tokens.shape[0] != expected:
                    raise ValueError(
                        f"document {piece.document} was packed with {expected} tokens, "
                        f"got tokens of shape {tuple(tokens.shape)}"
                    )
                out[row, piece.column : piece.column + piece.length] = tokens[
                    piece.offset : piece.offset + piece.length
                ]
        return out


class _Budgets(NamedTuple):
    sequence: int
    alignment: int
    max_documents: int
    budget: int
    multiple: int
    split: bool


def _budgets(
    sequence: object, alignment: object, max_documents: object, budget: object, multiple: object, split: object
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
    return _Budgets(sequence, alignment, max_documents, budget, multiple, split)


def _document_length(value: object, index: int) -> int:
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"document {index}: a length must be an int, got a bool")
    try:
        length = operator.index(value)
    except TypeError:
        raise TypeError(f"document {index}: a length must be an int, got {type(value).__name__}") from None
    if length < 1:
        raise ValueError(f"document {index}: lengths must be positive, got {length}")
    return length


def _check_iterable(lengths: object) -> None:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise TypeError(f"lengths must be an iterable of ints, got {type(lengths).__name__}")


def _rows(lengths: Iterable, budgets: _Budgets) -> Iterator[tuple[list[Piece], dict[int, int]]]:
    """Next-fit over ``lengths``: yield each full row, with the full lengths of the documents it holds."""
    _check_iterable(lengths)
    sequence, alignment, cap, budget, multiple, split = budgets
    row: list[Piece] = []
    totals: dict[int, int] = {}
    used_span = used_aligned = 0

    def place(index: int, offset: int, length: int, total: int) -> None:
        nonlocal used_span, used_aligned
        span = round_up(length, multiple)
        row.append(Piece(index, offset, length, span, used_span))
        totals[index] = total
        used_span += span
        used_aligned += round_up(length, alignment)

    for index, value in enumerate(lengths):
        length = _document_length(value, index)
        span, aligned = round_up(length, multiple), round_up(length, alignment)
        if span <= sequence and aligned <= budget:  # fits an empty row: never split
            if len(row) == cap or used_span + span > sequence or used_aligned + aligned > budget:
                yield row, totals
                row, totals, used_span, used_aligned = [], {}, 0, 0
            place(index, 0, length, length)
            continue
        if not split:
            raise ValueError(
                f"document {index} of {length} tokens does not fit an empty row: it takes {span} input columns "
                f"(sequence={sequence}) and {aligned} aligned columns (budget={budget}); "
                "pass split=True to cut it into pieces"
            )
        offset = 0
        while offset < length:
            # The longest piece the row has room for: its aligned size within
            # the budget (a multiple of alignment), its span within the row.
            room = min(budget - used_aligned, (sequence - used_span) // multiple * multiple)
            if len(row) == cap or room < 1:
                yield row, totals
                row, totals, used_span, used_aligned = [], {}, 0, 0
                continue
            piece = min(room, length - offset)
            place(index, offset, piece, length)
            offset += piece
    if row:
        yield row, totals


def _batch(rows: list[tuple[list[Piece], dict[int, int]]], batch: int, budgets: _Budgets) -> PackedBatch:
    sequence, cap = budgets.sequence, budgets.max_documents
    document_ids = torch.zeros(batch, sequence, dtype=torch.int64)
    seq_lens = [[0] * cap for _ in range(batch)]
    spans = [[0] * cap for _ in range(batch)]
    totals: dict[int, int] = {}
    for index, (pieces, row_totals) in enumerate(rows):
        totals.update(row_totals)
        for slot, piece in enumerate(pieces):
            document_ids[index, piece.column : piece.column + piece.length] = slot + 1
            seq_lens[index][slot] = piece.length
            spans[index][slot] = piece.span
    return PackedBatch(
        rows=tuple(tuple(pieces) for pieces, _ in rows) + ((),) * (batch - len(rows)),
        document_ids=document_ids,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64).reshape(batch, cap),
        seq_lens_padded=torch.tensor(spans, dtype=torch.int64).reshape(batch, cap),
        sequence=sequence,
        alignment=budgets.alignment,
        budget=budgets.budget,
        max_documents=cap,
        document_lengths=totals,
    )


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
) -> PackedBatch:
    """Pack documents, in order, into rows that fit the static budgets.

    Args:
        lengths: Real token count of each document (positive ints), in order.
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

    Returns:
        :class:`PackedBatch` with ``document_ids`` int64 ``[batch, sequence]``
        and ``seq_lens`` / ``seq_lens_padded`` int64 ``[batch, max_documents]``.

    Raises:
        TypeError: an argument or a length that is not an int (bools
            included), or ``lengths`` that is not iterable.
        ValueError: a length below 1; a budget that is not a multiple of
            ``alignment``; ``pad_to_multiple_of > sequence``; a document
            that does not fit an empty row without ``split``; documents that
            need more than ``batch`` rows; no document with ``batch`` unset.

    Example (``sequence=16, alignment=4, max_documents=3``, so ``budget=16``)::

        >>> packed = pack_documents([5, 3, 6, 2, 9], sequence=16, alignment=4, max_documents=3)
        >>> [[piece.document for piece in row] for row in packed.rows]
        [[0, 1], [2, 3], [4]]
        >>> packed.seq_lens.tolist()
        [[5, 3, 0], [6, 2, 0], [9, 0, 0]]
        >>> packed.document_ids[0].tolist()
        [1, 1, 1, 1, 1, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0]
        >>> packed.budget, packed.fill_ratio  # vs safe_budget(16, 3, 4) == 24 columns
        (16, 0.5208333333333334)

    Documents 0 and 1 take 8 + 4 aligned columns; document 2 (8 more) would
    pass the budget, so it starts row 1. ``split=True`` would cut a
    20-token document into pieces of 16 and 4 tokens.
    """
    budgets = _budgets(sequence, alignment, max_documents, budget, pad_to_multiple_of, split)
    if batch is not None:
        batch = check_positive_int(batch, "batch")
    rows = list(_rows(lengths, budgets))
    if batch is None:
        if not rows:
            raise ValueError("no document to pack: pass batch=... for a batch of empty rows")
        batch = len(rows)
    elif len(rows) > batch:
        raise ValueError(f"the documents need {len(rows)} rows, more than batch={batch}")
    return _batch(rows, batch, budgets)


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
) -> Iterator[PackedBatch]:
    """Pack a stream of documents into batches of ``batch`` rows each (lazily).

    Rows are filled as in :func:`pack_documents`, one after the other over
    the whole stream (a split document may continue in the next batch);
    every ``batch`` rows make one :class:`PackedBatch`, so every batch has
    the same shapes. The stream is read only as far as the batches asked
    for need (plus the one document that closes the last row).

    Args:
        lengths: Real token counts (an iterable, possibly endless).
        batch: Rows per batch.
        sequence, alignment, max_documents, budget, pad_to_multiple_of, split:
            as in :func:`pack_documents`.
        drop_last: Drop the last batch when the stream ends before it is
            full (otherwise it is padded with empty rows).

    Yields:
        :class:`PackedBatch` whose :class:`Piece` ``document`` indices count
        from the start of the stream.

    Raises:
        TypeError, ValueError: as :func:`pack_documents`: bad arguments at
            the call, a bad document when the stream reaches it.
    """
    budgets = _budgets(sequence, alignment, max_documents, budget, pad_to_multiple_of, split)
    batch = check_positive_int(batch, "batch")
    _check_iterable(lengths)
    return _stream(lengths, batch, budgets, drop_last)


def _stream(lengths: Iterable, batch: int, budgets: _Budgets, drop_last: bool) -> Iterator[PackedBatch]:
    pending: list[tuple[list[Piece], dict[int, int]]] = []
    for row in _rows(lengths, budgets):
        pending.append(row)
        if len(pending) == batch:
            yield _batch(pending, batch, budgets)
            pending = []
    if pending and not drop_last:
        yield _batch(pending, batch, budgets)
