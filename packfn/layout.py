"""Compression-aligned packed layouts of a fixed row budget, with no host sync.

The layout format (every docstring here refers to it): a row of
the input holds documents back to back; ``seq_lens[b, k]`` is the real
length ``n`` of the document in slot ``k + 1`` of row ``b`` and
``seq_lens_padded[b, k]`` its physical span ``s >= n`` (real tokens first,
then ``s - n`` columns of padding that belong to it). ``0`` marks an
absent document: it keeps its slot id but has no tokens and no span.
The aligned row writes each document's ``n`` real tokens at the next start
that is a multiple of ``alignment``. Example, ``alignment=4``, one row of
``sequence_length=9``::

    seq_lens        = [[3, 0, 5]]           # slot 2 is absent
    seq_lens_padded = [[4, 0, 5]]           # document 1 has one padding column
    input columns:     0 1 2 (3) 4 5 6 7 8
    aligned row:       0 1 2 . 4 5 6 7 8 . . .       (length 12)
    source_indices  = [[0, 1, 2, -1, 4, 5, 6, 7, 8, -1, -1, -1]]
    position_ids    = [[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0]]
    sequence_ids    = [[1, 1, 1, 0, 3, 3, 3, 3, 3, 0, 0, 0]]
    input_positions = [[0, 1, 2, -1, 4, 5, 6, 7, 8]]

``source_indices`` and ``input_positions`` are each other's inverse on real
tokens: ``source_indices[b, input_positions[b, i]] == i`` wherever
``input_positions[b, i] >= 0``.

:func:`aligned_layout` takes the aligned row length from the caller (the
pack budget), so every output shape follows from input shapes and static
arguments, nothing syncs with the host, and a compiled graph never
specializes on the lengths' contents; :func:`safe_budget` is the budget
that fits any row. NeMo AutoModel's ``packed_layout``, whose row length
depends on the data, is reproduced in :mod:`packfn.nemo_automodel`.

:meth:`PackedSequenceLayout.pack` and :meth:`PackedSequenceLayout.restore`
move activations into and out of the aligned rows with gathers; each is the
other's backward (see NOTE [Why pack and restore are each other's backward]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from packfn._checks import (
    check_gatherable,
    check_int,
    check_positive_int,
    check_same_device,
    check_scalar_fits,
    check_tensor,
)
from packfn._compat import sym_max, sym_min
from packfn._ops import layout as _ops
from packfn._ops._registry import assert_rules
from packfn._utils import cdiv

__all__ = ["LENGTH_DTYPES", "PackedSequenceLayout", "aligned_layout", "as_rows", "safe_budget"]

LENGTH_DTYPES = (torch.int32, torch.int64)
"""The dtypes of ``seq_lens`` / ``seq_lens_padded`` tables."""


@dataclass(frozen=True)
class PackedSequenceLayout:
    """Compression-aligned packed rows and the coordinates to go back.

    Attributes:
        source_indices: int64 ``[batch, length]``: the input column each
            aligned column reads, -1 at padding.
        input_positions: int64 ``[batch, sequence]``: the aligned column of
            each input column, -1 at padding (spans' padding and the rest of
            the row) which is discarded.
        position_ids: int64 ``[batch, length]``: position inside the
            document (RoPE positions), 0 at padding.
        sequence_ids: int64 ``[batch, length]``: the 1-based document slot,
            0 at padding.
    """

    source_indices: torch.Tensor
    input_positions: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor

    def _check_values(self, values: torch.Tensor, width: int, axis: str) -> None:
        check_tensor(values, "values")
        check_gatherable(values.dtype, "values")
        check_same_device(values, "values", self.source_indices, "the layout")
        batch = self.source_indices.shape[0]
        if values.ndim < 2 or values.shape[0] != batch or values.shape[1] != width:
            raise ValueError(f"values must have shape [batch={batch}, {axis}={width}, ...], got {tuple(values.shape)}")

    def pack(self, values: torch.Tensor, *, fill: int | float = 0) -> torch.Tensor:
        """Move tokens into the aligned rows, inserting alignment padding.

        Args:
            values: ``[batch, sequence, ...]`` of any dtype and trailing axes.
            fill: Value written at padding columns.

        Returns:
            A new ``[batch, length, ...]`` tensor. Its gradient flows back to
            real tokens only (it is :meth:`restore` of the output gradient).
            For the example layout, ``pack(arange(9)[None])`` is
            ``[[0, 1, 2, f, 4, 5, 6, 7, 8, f, f, f]]`` with ``f = fill``.

        Raises:
            TypeError: ``values`` is not a tensor or ``fill`` not a number.
            ValueError: ``values`` does not start with ``[batch, sequence]``
                or has a dtype torch's gathers lack (uint16, uint32, uint64,
                the float8 types), or ``fill`` is a value their dtype cannot
                hold (a fraction, infinity or NaN for an integral dtype, a
                value outside its range, an int past ``2**53`` that the op's
                float64 scalar would round; a finite value outside a floating
                dtype's range, an int a floating dtype would round).
        """
        self._check_values(values, self.input_positions.shape[1], "sequence")
        # The op takes fill as a float64 and casts it to the values' dtype, which would truncate a fraction and
        # wrap a value outside the dtype: checked here, on the Python scalar, with no read of the data.
        fill = check_scalar_fits(fill, values.dtype, "fill")
        if isinstance(fill, int) and float(fill) != fill:
            raise ValueError(f"fill={fill!r} does not pass exactly as the op's float64 scalar: use one within 2**53")
        return _ops.pack_op(values, self.source_indices, self.input_positions, float(fill))

    def restore(self, values: torch.Tensor) -> torch.Tensor:
        """Move tokens back to the input columns, with zeros at the input's padding.

        Args:
            values: ``[batch, length, ...]`` of any dtype and trailing axes.

        Returns:
            A new ``[batch, sequence, ...]`` tensor. Its gradient flows back
            to real tokens only (it is :meth:`pack` of the output gradient
            with zero fill). ``restore(pack(x))`` equals ``x`` at real tokens.

        Raises:
            TypeError: ``values`` is not a tensor.
            ValueError: ``values`` does not start with ``[batch, length]`` or
                has a dtype torch's gathers lack (as :meth:`pack`).
        """
        self._check_values(values, self.source_indices.shape[1], "length")
        return _ops.restore_op(values, self.input_positions, self.source_indices)


def worst_case_budget(sequence_length, documents: int, alignment: int, minimum_budget: int):
    """:func:`safe_budget` without checks (SymInt-friendly, for traced sequence lengths)."""
    # m documents of n_1 + ... + n_m <= sequence_length real tokens use
    # sum(ceil(n_k / a)) <= floor((tokens + m (a - 1)) / a) = m + floor((tokens - m) / a)
    # blocks, which grows with tokens and m: the bound takes every token and
    # as many documents as there are tokens (no token without a document).
    # m - 1 one-token documents and one document of the rest reach it.
    # Written as alignment * blocks, so that "a multiple of alignment" holds
    # symbolically (no guard on a traced sequence length).
    floor_blocks = cdiv(max(minimum_budget, 1), alignment)
    if documents == 0:
        return alignment * floor_blocks
    fitting = sym_min(documents, sequence_length)
    blocks = fitting + (sequence_length - fitting) // alignment
    return alignment * sym_max(blocks, floor_blocks)


def safe_budget(sequence_length: int, documents: int, alignment: int, minimum_budget: int = 0) -> int:
    """Return the shortest aligned row length (budget) that fits every valid input.

    Each present document wastes at most ``alignment - 1`` columns, and the
    real tokens of a row are at most ``sequence_length``; the bound is
    reached by ``documents - 1`` one-token documents plus one document of the
    remaining tokens. A packer that counts aligned sizes
    (:func:`packfn.pack_documents`) guarantees a tighter budget.

    Args:
        sequence_length: Input row length ``sequence``.
        documents: Document slots per row (``seq_lens.shape[-1]``).
        alignment: Positive alignment of document starts.
        minimum_budget: Minimum row length, as ``minimum_length`` of
            NeMo AutoModel's ``packed_layout``.

    Returns:
        A positive multiple of ``alignment`` usable as ``budget`` of
        :func:`aligned_layout` (a SymInt when ``sequence_length`` is one,
        for compiles with dynamic sequence lengths). Example: ``safe_budget(9, 3, 4) == 16``
        (one-token documents at 0 and 4, seven tokens at 8..14).

    Raises:
        TypeError: an argument is not an int.
        ValueError: ``sequence_length`` or ``documents`` is negative,
            ``alignment`` is not positive, an argument or the budget is
            past int64.
    """
    check_int(sequence_length, "sequence_length", minimum=0)
    check_int(documents, "documents", minimum=0)
    check_int(minimum_budget, "minimum_budget")
    alignment = check_positive_int(alignment, "alignment")
    budget = worst_case_budget(sequence_length, documents, alignment, minimum_budget)
    if isinstance(budget, int) and budget >= 2**63:
        raise ValueError(f"the safe budget of these arguments, {budget}, is past int64")
    return budget


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[batch, documents]`` length tables: a 1-d table is one row."""
    return tensor.unsqueeze(0) if tensor.ndim == 1 else tensor


def aligned_layout(
    seq_lens: torch.Tensor,
    seq_lens_padded: torch.Tensor | None = None,
    *,
    sequence_length: int,
    alignment: int,
    budget: int,
) -> PackedSequenceLayout:
    """Build an aligned layout of fixed row length ``budget``, with no host sync.

    Args:
        seq_lens: int32 or int64 ``[batch, documents]`` (or ``[documents]``
            for batch one) real document lengths; 0 marks an absent slot.
        seq_lens_padded: Physical spans, same shape, each at least its
            length (default: the lengths, documents back to back).
        sequence_length: Input row length ``sequence``.
        alignment: Positive alignment of document starts.
        budget: Aligned row length, a positive multiple of ``alignment``:
            the packer's budget (:class:`packfn.PackedBatch` ``budget``), or
            :func:`safe_budget` for one that fits any row.

    Returns:
        :class:`PackedSequenceLayout` with ``[batch, budget]`` aligned
        fields and ``[batch, sequence_length]`` ``input_positions``, on
        ``seq_lens.device``. For the example above
        (``sequence_length=9, alignment=4, budget=12``) the fields shown
        there.

    Raises:
        TypeError: a non-tensor length table or non-int static argument.
        ValueError: lengths that are not integer, shapes that do not match,
            or static arguments out of range.
        RuntimeError: (asynchronously on a GPU) an absent document with a
            span, a negative length, a span shorter than its length, spans
            past the input row, or aligned documents that do not fit
            ``budget``.
    """
    lengths = as_rows(check_tensor(seq_lens, "seq_lens"))
    spans = lengths if seq_lens_padded is None else as_rows(check_tensor(seq_lens_padded, "seq_lens_padded"))
    if lengths.ndim != 2 or spans.shape != lengths.shape:
        raise ValueError(
            "seq_lens and seq_lens_padded must have matching [batch, documents] shapes, "
            f"got {tuple(seq_lens.shape)} and {tuple(spans.shape)}"
        )
    for name, tensor in (("seq_lens", lengths), ("seq_lens_padded", spans)):
        if tensor.dtype not in LENGTH_DTYPES:
            raise ValueError(f"{name} must hold int32 or int64 document lengths, got dtype {tensor.dtype}")
    check_same_device(spans, "seq_lens_padded", lengths, "seq_lens")
    check_int(sequence_length, "sequence_length", minimum=0)
    alignment = check_positive_int(alignment, "alignment")
    budget = check_positive_int(budget, "budget")
    if budget % alignment != 0:
        raise ValueError(f"budget={budget} must be a multiple of alignment={alignment}")
    layout = _ops.aligned_layout_op(lengths, spans, sequence_length, alignment, budget)
    assert_rules(layout.broken, _ops.layout_rules(budget))
    return PackedSequenceLayout(layout.source_indices, layout.input_positions, layout.position_ids, layout.sequence_ids)
