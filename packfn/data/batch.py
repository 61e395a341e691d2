"""A packed batch: which piece of which document sits where, and the tensors a model takes."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, reduce
from typing import NamedTuple

import torch

from packfn._checks import check_fits_int64, check_gatherable, check_scalar_fits, integer_range

__all__ = ["CLOSED_BY", "PackedBatch", "Piece", "Pieces", "document_ids", "token_positions"]

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
CLOSED_TOKENS, CLOSED_BUDGET, CLOSED_DOCUMENTS, CLOSED_END = range(4)  # the codes of CLOSED_BY


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

    :func:`packfn.data.packing_stats` sums it up: fill, documents per row,
    split pieces and the rows each reason closed.
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
            padding: Value written at padding columns: an int or float
                ``dtype`` holds as it is.
            dtype: dtype of the result; by default the documents' dtypes
                promoted together (a tensor's own, int64 for a list of
                ints, float32 for a list of floats).

        Returns:
            ``dtype`` ``[batch, sequence]``: each piece's tokens at its
            columns, ``padding`` elsewhere. In the example of
            :func:`pack_documents`, ``gather([[1, 2, 3, 4], ...])[0, :4]``
            is ``[1, 2, 3, 4]`` (document 0 opens row 0).

        Raises:
            TypeError: ``padding`` is not a real number.
            ValueError: ``documents`` has no entry for a packed document, a
                document's token count is not the length it was packed
                with, its tokens are not 1-D, or it holds values ``dtype``
                cannot hold (floating values an integral ``dtype`` would
                truncate, integers outside its range); ``padding`` is a
                value ``dtype`` cannot hold (a fraction, infinity or NaN for
                an integral ``dtype``, an integer outside its range, a
                finite value outside a floating ``dtype``'s range).
        """
        pieces = self.pieces
        slices, defaults = [], []
        for document, offset, length, total in zip(
            pieces.document.tolist(), pieces.offset.tolist(), pieces.length.tolist(), pieces.total.tolist(), strict=True
        ):
            try:
                entry = documents[document]
            except (KeyError, IndexError):
                raise ValueError(f"documents has no entry for document {document}, which this batch packs") from None
            values, default = _document_values(entry, document)
            if values.ndim != 1 or values.shape[0] != total:
                raise ValueError(
                    f"document {document} was packed with {total} tokens, got tokens of shape {tuple(values.shape)}"
                )
            # The ints of a list that holds floats too: read with them as floats, they are checked on their own.
            mixed = isinstance(entry, (list, tuple)) and (values.is_floating_point() or values.is_complex())
            integers = [value for value in entry[offset : offset + length] if type(value) is int] if mixed else []
            slices.append((document, values[offset : offset + length], integers))
            defaults.append(default)
        if dtype is None:
            try:
                dtype = reduce(torch.promote_types, defaults) if defaults else torch.int64
            except RuntimeError as error:  # no promotion between uint16 / 32 / 64 and the signed dtypes
                raise ValueError(f"the documents' dtypes have no common dtype ({error}): pass dtype") from None
        elif not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__}")
        check_gatherable(dtype, "dtype")
        padding = check_scalar_fits(padding, dtype, "padding")
        for (document, values, integers), default in zip(slices, defaults, strict=True):
            _check_holds(values, dtype, document, default)
            if integers and (dtype.is_floating_point or dtype.is_complex):
                _check_integers(integers, dtype, document)
        out = torch.full((self.batch * self.sequence,), padding, dtype=dtype)
        if slices:
            out.index_copy_(
                0,
                token_positions(pieces.row * self.sequence + pieces.column, pieces.length),
                torch.cat([values.to(dtype) for _, values, _ in slices]),
            )
        return out.view(self.batch, self.sequence)


def token_positions(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 ``[sum(lengths)]``: ``starts[k], ..., starts[k] + lengths[k] - 1`` for each ``k`` in turn."""
    total = int(lengths.sum())
    ends = torch.cumsum(lengths, 0)
    shift = torch.repeat_interleave(starts - (ends - lengths), lengths, output_size=total)
    return torch.arange(total, dtype=torch.int64) + shift


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


def _document_values(entry: object, document: int) -> tuple[torch.Tensor, torch.dtype]:
    """A document's values and the dtype they default to.

    A list of floats defaults to float32 (complex64 for complex numbers) but is
    read in double precision, so a ``dtype`` that holds its values gets them
    unrounded and float32 refuses what it would overflow.
    """
    try:
        values = torch.as_tensor(entry)
        if not hasattr(entry, "dtype") and (values.is_floating_point() or values.is_complex()):
            return torch.as_tensor(
                entry, dtype=torch.complex128 if values.is_complex() else torch.float64
            ), values.dtype
    except (OverflowError, RuntimeError, TypeError, ValueError) as error:  # ints past int64, strings, ragged lists
        raise ValueError(f"document {document}'s tokens are not a tensor of numbers torch holds: {error}") from None
    return values, values.dtype


def _check_integers(integers: list[int], dtype: torch.dtype, document: int) -> None:
    """Raise ``ValueError`` where a floating ``dtype`` would round one of a list's ints (read among floats)."""
    for value in integers:
        try:
            check_scalar_fits(value, dtype, "value")
        except ValueError:
            raise ValueError(
                f"document {document} holds integers {dtype} cannot hold exactly (it would round them)"
            ) from None


def _check_holds(values: torch.Tensor, dtype: torch.dtype, document: int, default: torch.dtype) -> None:
    """Raise ``ValueError`` where ``values`` would not survive a cast to ``dtype`` (truncated, wrapped, rounded).

    ``default`` is the document's own dtype, which messages name (a list of
    floats is read as float64 but is float32).
    """
    if not values.numel() or values.dtype == dtype:
        return
    if values.is_complex() and not dtype.is_complex:
        raise ValueError(f"document {document} holds complex values, whose imaginary parts {dtype} would drop")
    if values.dtype in (torch.uint16, torch.uint32, torch.uint64):  # few kernels take them: compare as int64
        check_fits_int64(values, f"document {document}")
        values = values.view(torch.int64) if values.dtype == torch.uint64 else values.to(torch.int64)
    if dtype.is_floating_point or dtype.is_complex:
        cast = values.to(dtype)
        if bool((torch.isinf(cast) & ~torch.isinf(values)).any()):
            limit = torch.finfo(dtype).max
            raise ValueError(f"document {document} holds values outside [{-limit}, {limit}], which {dtype} cannot hold")
        back = (cast.real if cast.is_complex() else cast).to(values.dtype)  # an integer's imaginary part is 0
        if not (values.is_floating_point() or values.is_complex()) and not torch.equal(back, values):
            raise ValueError(f"document {document} holds integers {dtype} cannot hold exactly (it would round them)")
        return  # a float may round
    if values.is_floating_point() or values.is_complex():
        raise ValueError(
            f"document {document} holds {default} values, which gather(dtype={dtype}) would truncate; "
            "pass a floating dtype"
        )
    low, high = integer_range(dtype)
    if int(values.min()) < low or int(values.max()) > high:
        raise ValueError(f"document {document} holds values outside [{low}, {high}], which {dtype} cannot hold")
