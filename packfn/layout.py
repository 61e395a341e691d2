"""Compression-aligned packed layouts: the static API and the NeMo AutoModel drop-in.

The layout format, with a worked example, is described once, in
:mod:`packfn._ops.layout`.

Static API (:func:`aligned_layout`, :func:`aligned_length`): the aligned row
has a fixed length chosen by the caller (the pack budget), so every output
shape follows from input shapes and static arguments, nothing syncs with the
host, and a compiled graph never specializes on the lengths' contents.

Drop-in API (:func:`packed_layout`): exactly the outputs of
``nemo_automodel.components.models.deepseek_v41.packing.packed_layout``
0.7.0, whose row length depends on the data: in eager one host read (the
rule flags and the row length together), under ``torch.compile`` and
``torch.export`` the static op at a safe length and one trim to an unbacked
size, never a graph break.

:meth:`PackedSequenceLayout.pack` and :meth:`PackedSequenceLayout.restore`
move activations into and out of the aligned rows with gathers; each is the
other's backward (see NOTE [Why pack and restore are each other's backward]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from packfn._checks import check_positive_int, exact_on_cpu
from packfn._ops import layout as _ops
from packfn._ops._registry import assert_rules, checked_ints, refuse_jit_trace

__all__ = ["PackedSequenceLayout", "aligned_layout", "aligned_length", "packed_layout"]

_LENGTH_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class PackedSequenceLayout:
    """Compression-aligned packed rows and the coordinates to go back (same fields as upstream).

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
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
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
            ValueError: ``values`` does not start with ``[batch, sequence]``.
        """
        self._check_values(values, self.input_positions.shape[1], "sequence")
        if not isinstance(fill, (int, float)):
            raise TypeError(f"fill must be an int or float, got {type(fill).__name__}")
        return _ops.pack(values, self.source_indices, self.input_positions, float(fill))

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
            ValueError: ``values`` does not start with ``[batch, length]``.
        """
        self._check_values(values, self.source_indices.shape[1], "length")
        return _ops.restore(values, self.input_positions, self.source_indices)


def _round_up(value, alignment):
    return (value + alignment - 1) // alignment * alignment


def _sym_min(a, b):
    """``min`` of ints or SymInts that installs no guard (so export keeps a ``Dim`` free).

    Dynamo turns the builtin ``min`` of SymInts into ``torch.sym_min``
    itself, and torch 2.11's Dynamo graph-breaks on an explicit
    ``torch.sym_min`` of ints ("torch.* op returned non-Tensor"); outside
    Dynamo (eager, non-strict export) the builtin would guard on the
    comparison, so ``torch.sym_min`` is used there.
    """
    return min(a, b) if torch.compiler.is_dynamo_compiling() else torch.sym_min(a, b)


def _sym_max(a, b):
    """``max`` without a guard, as :func:`_sym_min`."""
    return max(a, b) if torch.compiler.is_dynamo_compiling() else torch.sym_max(a, b)


def _worst_case_length(sequence_length, documents: int, alignment: int, minimum_length: int):
    """:func:`aligned_length` without checks (SymInt-friendly, for traced sequence lengths)."""
    # m documents of n_1 + ... + n_m <= sequence_length real tokens use
    # sum(ceil(n_k / a)) <= floor((tokens + m (a - 1)) / a) = m + floor((tokens - m) / a)
    # blocks, which grows with tokens and m: the bound takes every token and
    # as many documents as there are tokens (no token without a document).
    # m - 1 one-token documents and one document of the rest reach it.
    # Written as alignment * blocks, so that "a multiple of alignment" holds
    # symbolically (no guard on a traced sequence length).
    floor_blocks = -(-max(minimum_length, 1) // alignment)
    if documents == 0:
        return alignment * floor_blocks
    fitting = _sym_min(documents, sequence_length)
    blocks = fitting + (sequence_length - fitting) // alignment
    return alignment * _sym_max(blocks, floor_blocks)


def aligned_length(sequence_length: int, documents: int, alignment: int, minimum_length: int = 0) -> int:
    """Return the shortest aligned row length that fits every valid input.

    Each present document wastes at most ``alignment - 1`` columns, and the
    real tokens of a row are at most ``sequence_length``; the bound is
    reached by ``documents - 1`` one-token documents plus one document of the
    remaining tokens.

    Args:
        sequence_length: Input row length ``sequence``.
        documents: Document slots per row (``seq_lens.shape[-1]``).
        alignment: Positive alignment of document starts.
        minimum_length: Minimum row length, as in :func:`packed_layout`.

    Returns:
        A positive multiple of ``alignment`` usable as ``length`` of
        :func:`aligned_layout` (a SymInt when ``sequence_length`` is one,
        for compiles with dynamic sequence lengths). Example: ``aligned_length(9, 3, 4) == 16``
        (one-token documents at 0 and 4, seven tokens at 8..14).

    Raises:
        TypeError: an argument is not an int.
        ValueError: ``sequence_length`` or ``documents`` is negative, or
            ``alignment`` is not positive.
    """
    for name, value in (
        ("sequence_length", sequence_length),
        ("documents", documents),
        ("minimum_length", minimum_length),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    for value in (sequence_length, documents):
        if isinstance(value, int) and value < 0:
            raise ValueError(f"sequence_length and documents must not be negative, got {sequence_length}, {documents}")
    alignment = check_positive_int(alignment, "alignment")
    return _worst_case_length(sequence_length, documents, alignment, minimum_length)


def _check_lengths(tensor: object, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.unsqueeze(0) if tensor.ndim == 1 else tensor


def aligned_layout(
    seq_lens: torch.Tensor,
    seq_lens_padded: torch.Tensor | None = None,
    *,
    sequence_length: int,
    alignment: int,
    length: int,
) -> PackedSequenceLayout:
    """Build an aligned layout of fixed row length, with no host sync.

    Args:
        seq_lens: int32 or int64 ``[batch, documents]`` (or ``[documents]``
            for batch one) real document lengths; 0 and -1000 mark absent
            slots.
        seq_lens_padded: Physical spans, same shape, each at least its
            length (default: the lengths, documents back to back).
        sequence_length: Input row length ``sequence``.
        alignment: Positive alignment of document starts.
        length: Aligned row length, a positive multiple of ``alignment``
            (see :func:`aligned_length` for one that always fits).

    Returns:
        :class:`PackedSequenceLayout` with ``[batch, length]`` aligned
        fields and ``[batch, sequence_length]`` ``input_positions``, on
        ``seq_lens.device``. For the example of :mod:`packfn._ops.layout`
        (``sequence_length=9, alignment=4, length=12``) the fields shown
        there.

    Raises:
        TypeError: a non-tensor length table or non-int static argument.
        ValueError: lengths that are not integer, shapes that do not match,
            or static arguments out of range.
        RuntimeError: (asynchronously on a GPU) an absent document with a
            span, a negative length, a span shorter than its length, spans
            past the input row, or aligned documents that do not fit
            ``length``.
    """
    _check_lengths(seq_lens, "seq_lens")
    lengths = _as_rows(seq_lens)
    spans = lengths if seq_lens_padded is None else seq_lens_padded
    _check_lengths(spans, "seq_lens_padded")
    spans = _as_rows(spans)
    if lengths.ndim != 2 or spans.shape != lengths.shape:
        raise ValueError(
            "seq_lens and seq_lens_padded must have matching [batch, documents] shapes, "
            f"got {tuple(seq_lens.shape)} and {tuple(spans.shape)}"
        )
    for name, tensor in (("seq_lens", lengths), ("seq_lens_padded", spans)):
        if tensor.dtype not in _LENGTH_DTYPES:
            raise ValueError(f"{name} must hold int32 or int64 document lengths, got dtype {tensor.dtype}")
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, (int, torch.SymInt)):
        raise TypeError(f"sequence_length must be an int, got {type(sequence_length).__name__}")
    if isinstance(sequence_length, int) and sequence_length < 0:
        raise ValueError(f"sequence_length must not be negative, got {sequence_length}")
    alignment = check_positive_int(alignment, "alignment")
    length = check_positive_int(length, "length")
    if length % alignment != 0:
        raise ValueError(f"length={length} must be a multiple of alignment={alignment}")
    layout = _ops.aligned_layout(lengths, spans, sequence_length, alignment, length)
    assert_rules(layout.broken, _ops.layout_rules(length))
    return PackedSequenceLayout(layout.source_indices, layout.input_positions, layout.position_ids, layout.sequence_ids)


# ---------------------------------------------------------------- drop-in


def packed_layout(
    seq_lens: torch.Tensor,
    *,
    seq_lens_padded: torch.Tensor | None,
    input_shape: tuple[int, int],
    alignment: int,
    minimum_length: int = 0,
) -> PackedSequenceLayout:
    """Validate packed spans and align document starts (drop-in for upstream ``packed_layout``).

    Args:
        seq_lens: int32 or int64 ``[batch, documents]`` (or ``[documents]``
            for batch one) real document lengths; 0 and -1000 mark absent
            slots.
        seq_lens_padded: Physical spans of the same shape, or ``None``
            (documents back to back).
        input_shape: ``(batch, sequence)`` of the input rows.
        alignment: Positive alignment of document starts.
        minimum_length: Minimum aligned row length (a fixed pack budget).

    Returns:
        :class:`PackedSequenceLayout` on ``seq_lens.device`` whose row
        length is ``max(minimum_length, 1, longest aligned row)`` rounded up
        to ``alignment``: 12 for the example of :mod:`packfn._ops.layout`.
        Under ``torch.compile`` / ``torch.export`` that length is an
        unbacked size.

    Raises:
        ValueError: upstream's messages, in upstream's order: non-positive
            alignment, non-integer dtypes, mismatched shapes, an absent
            document with a span, and a negative length, a span shorter
            than its length or spans past the input row. Under
            ``torch.compile`` / ``torch.export`` the data errors are
            sync-free asserts (``RuntimeError``) with the same messages.
    """
    refuse_jit_trace()
    if alignment < 1:
        raise ValueError("Packed alignment must be positive")
    _check_lengths(seq_lens, "seq_lens")
    if seq_lens.dtype not in _LENGTH_DTYPES:
        raise ValueError("seq_lens must contain integer document lengths")
    lengths = _as_rows(seq_lens)
    spans = lengths if seq_lens_padded is None else seq_lens_padded
    _check_lengths(spans, "seq_lens_padded")
    spans = _as_rows(spans)
    batch, sequence = _check_input_shape(input_shape)
    if lengths.ndim != 2 or lengths.shape[0] != batch or spans.shape != lengths.shape:
        raise ValueError("seq_lens and seq_lens_padded must have matching [batch, documents] shapes")
    if spans.dtype not in _LENGTH_DTYPES:
        raise ValueError("seq_lens_padded must contain integer document lengths")
    alignment = check_positive_int(alignment, "alignment")
    if isinstance(minimum_length, bool) or not isinstance(minimum_length, int):
        raise TypeError(f"minimum_length must be an int, got {type(minimum_length).__name__}")
    floor = max(minimum_length, 1)
    # The static op at a length every valid input fits, then one read of the
    # row length and the rule flags together (eager: one host sync and
    # upstream's ValueError; traced: an unbacked size and sync-free asserts
    # with upstream's messages), and one trim.
    bound = _worst_case_length(sequence, lengths.shape[1], alignment, minimum_length)
    exact = exact_on_cpu(lengths, spans)
    if exact:
        # NOTE [Exact sizes on the CPU]: the row length and the op's rule flags
        # from the document table, then the op's eager tables from the same
        # table at that length.
        table = _ops.DocumentTable.build(lengths, spans, alignment, sequence)
        longest, broken = table.checked(bound)
    else:
        layout = _ops.aligned_layout(lengths, spans, sequence, alignment, bound)
        longest, broken = layout.longest, layout.broken
    need = _round_up(longest.clamp_min(floor), alignment)
    (row_length,) = checked_ints([need], [bound], broken, _ops.layout_rules(bound))
    if exact:
        source_indices, position_ids, sequence_ids, input_positions = _ops.layout_tables(
            table, row_length, search_input=False
        )
        return PackedSequenceLayout(source_indices, input_positions, position_ids, sequence_ids)
    # The first row_length columns as new contiguous tensors (like upstream's
    # fields), taken by index_select rather than a slice: Inductor (torch
    # 2.13) can save a slice of unbacked width for the backward with other
    # strides than it planned for ("expected ... stride 4==8").
    columns = torch.arange(row_length, device=lengths.device)
    return PackedSequenceLayout(
        layout.source_indices.index_select(1, columns),
        layout.input_positions,
        layout.position_ids.index_select(1, columns),
        layout.sequence_ids.index_select(1, columns),
    )


def _check_input_shape(input_shape: Sequence[int]) -> tuple[int, int]:
    if len(input_shape) != 2:
        raise ValueError(f"input_shape must be (batch, sequence), got {input_shape}")
    batch, sequence = input_shape
    for name, value in (("batch", batch), ("sequence", sequence)):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
            raise TypeError(f"input_shape {name} must be an int, got {type(value).__name__}")
        if isinstance(value, int) and value < 0:
            raise ValueError(f"input_shape must not be negative, got {input_shape}")
    return batch, sequence
