"""NeMo AutoModel's ``models.deepseek_v41.packing.packed_layout`` 0.7.0, exactly.

Its row length depends on the data: in eager one host read (the rule flags
and the row length together), under ``torch.compile`` and ``torch.export``
the static op (:func:`packfn.aligned_layout`) at a safe length and one trim
to an unbacked size, never a graph break. :class:`packfn.PackedSequenceLayout`
(with ``pack`` / ``restore``) is upstream's result type.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from packfn._checks import check_int, check_positive_int, check_tensor
from packfn._compat import leading_columns
from packfn._ops import layout as _ops
from packfn._ops._registry import Rule
from packfn._utils import round_up
from packfn.layout import LENGTH_DTYPES, PackedSequenceLayout, as_rows, worst_case_budget
from packfn.nemo_automodel._exact import exact_on_cpu
from packfn.nemo_automodel._trim import checked_ints, refuse_jit_trace

__all__ = ["PackedSequenceLayout", "packed_layout"]


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
        to ``alignment``: 12 for the example of :mod:`packfn.layout`.
        Under ``torch.compile`` / ``torch.export`` that length is an
        unbacked size.

    Raises:
        ValueError: upstream's messages, in upstream's order: non-positive
            alignment, non-integer dtypes, mismatched shapes, an absent
            document with a span, and a negative length, a span shorter
            than its length or spans past the input row; an ``alignment``
            or ``minimum_length`` whose rows would pass int64. Under
            ``torch.compile`` / ``torch.export`` the data errors are
            sync-free asserts (``RuntimeError``) with the same messages.
    """
    refuse_jit_trace()
    alignment, minimum_length = _python_int(alignment), _python_int(minimum_length)
    if alignment < 1:
        raise ValueError("Packed alignment must be positive")
    check_tensor(seq_lens, "seq_lens")
    if seq_lens.dtype not in LENGTH_DTYPES:
        raise ValueError("seq_lens must contain integer document lengths")
    lengths = as_rows(seq_lens)
    spans = lengths if seq_lens_padded is None else as_rows(check_tensor(seq_lens_padded, "seq_lens_padded"))
    batch, sequence = _check_input_shape(input_shape)
    if lengths.ndim != 2 or lengths.shape[0] != batch or spans.shape != lengths.shape:
        raise ValueError("seq_lens and seq_lens_padded must have matching [batch, documents] shapes")
    if spans.dtype not in LENGTH_DTYPES:
        raise ValueError("seq_lens_padded must contain integer document lengths")
    alignment = check_positive_int(alignment, "alignment")
    if isinstance(minimum_length, torch.SymInt):
        raise TypeError("minimum_length must be an int, got SymInt")
    check_int(minimum_length, "minimum_length")
    floor = max(minimum_length, 1)
    # The static op at a length every valid input fits, then one read of the
    # row length and the rule flags together (eager: one host sync and
    # upstream's ValueError; traced: an unbacked size and sync-free asserts
    # with upstream's messages), and one trim.
    bound = worst_case_budget(sequence, lengths.shape[1], alignment, minimum_length)
    if isinstance(bound, int) and bound >= 2**63:  # the op's int64 positions would wrap (upstream: an overflow)
        raise ValueError(
            f"alignment={alignment} and minimum_length={minimum_length} allow rows of {bound} positions, past int64"
        )
    lengths, spans = _core_absent(lengths, spans)
    exact = exact_on_cpu(lengths, spans)
    if exact:
        # NOTE [Exact sizes on the CPU]: the row length and the op's rule flags
        # from the document table, then the op's eager tables from the same
        # table at that length.
        table = _ops.DocumentTable.build(lengths, spans, alignment, sequence)
        longest, broken = table.checked(bound)
    else:
        layout = _ops.aligned_layout_op(lengths, spans, sequence, alignment, bound)
        longest, broken = layout.longest, layout.broken
    need = round_up(longest.clamp_min(floor), alignment)
    (row_length,) = checked_ints([need], [bound], broken, _LAYOUT_RULES)
    if exact:
        source_indices, position_ids, sequence_ids, input_positions = _ops.layout_tables(
            table, row_length, search_input=False
        )
        return PackedSequenceLayout(source_indices, input_positions, position_ids, sequence_ids)
    # The first row_length columns as new contiguous tensors, like upstream's fields.
    return PackedSequenceLayout(
        leading_columns(layout.source_indices, row_length),
        layout.input_positions,
        leading_columns(layout.position_ids, row_length),
        leading_columns(layout.sequence_ids, row_length),
    )


ABSENT = -1000
"""The length upstream uses (besides 0) for an absent document; the core knows only 0."""

# Upstream's two messages, one per flag of the core's layout_rules: the first
# for an absent document with a span, the second for every other broken
# document and for the row length (upstream walks rows, then documents, and
# raises at the first broken one: the core flags the first broken document's rules).
_ABSENT_WITH_SPAN = "An absent packed document cannot have a physical span"
_SPAN_EXCEEDED = "Packed document lengths exceed their physical spans or input row"
_LAYOUT_RULES = (Rule(_ABSENT_WITH_SPAN), *(Rule(_SPAN_EXCEEDED) for _ in range(4)))


def _core_absent(lengths: torch.Tensor, spans: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's tables in the core's terms: an absent document's ``-1000`` length, and its ``-1000`` span, are 0."""
    absent = (lengths == ABSENT) | (lengths == 0)
    core_lengths = lengths.masked_fill(lengths == ABSENT, 0)
    if spans is lengths:
        return core_lengths, core_lengths
    return core_lengths, spans.masked_fill(absent & (spans == ABSENT), 0)


def _python_int(value: object) -> object:
    """A NumPy (or other non-bool) integer as the Python int upstream's arithmetic takes it; anything else as it is."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int, torch.SymInt)):
        return int(value)
    return value


def _check_input_shape(input_shape: Sequence[int]) -> tuple[int, int]:
    if len(input_shape) != 2:
        raise ValueError(f"input_shape must be (batch, sequence), got {input_shape}")
    batch, sequence = input_shape
    for name, value in (("batch", batch), ("sequence", sequence)):
        check_int(value, f"input_shape {name}")
        if isinstance(value, int) and value < 0:
            raise ValueError(f"input_shape must not be negative, got {input_shape}")
    return batch, sequence
