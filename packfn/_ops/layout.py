"""Ops that build compression-aligned packed layouts and move tokens in and out of them.

The layout format is defined, with a worked example, in :mod:`packfn.layout`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from packfn._ops._registry import Rule, named_value, packfn_op
from packfn._ops.metadata import search_running_sums
from packfn._ops.scan import running_sum
from packfn._utils import round_up

__all__ = [
    "AlignedLayoutOutputs",
    "DocumentTable",
    "aligned_layout_op",
    "layout_rules",
    "layout_tables",
    "pack_op",
    "restore_op",
]


def layout_rules(length: int) -> tuple[Rule, ...]:
    """Data rules of a layout, in the order of ``aligned_layout``'s ``broken`` flags.

    The first four are per document (the last axis of
    :meth:`DocumentTable.violations`); the op flags those of the first broken
    document in row-major order (rows, then documents), so the first flagged
    rule is that of the first broken document. The last is the static row
    length (the budget) ``length``.
    """
    return (
        Rule("an absent document (length 0) must not have a physical span in seq_lens_padded"),
        Rule("seq_lens must not hold negative document lengths"),
        Rule("a document's physical span in seq_lens_padded must not be shorter than its length in seq_lens"),
        Rule("the documents' physical spans must not run past the input row (sequence_length)"),
        Rule(f"the aligned documents of a row do not fit {named_value('budget', length)}"),
    )


class DocumentTable(NamedTuple):
    """Per-document tables of a ``[batch, documents]`` length pair (all int64).

    Attributes:
        lengths, spans: the raw tables.
        present: bool, which slots hold a document.
        real: the real length ``n`` (0 for absent slots, clamped to
            ``[0, sequence_length + 1]``).
        input_bounds, aligned_bounds: ``[batch, documents + 1]`` running
            starts of the documents in the input row (by physical span) and
            in the aligned row (by ``n`` rounded up to ``alignment``), from 0
            to the row total.
        sequence_length, alignment: the input row and the alignment the
            table was built for.
    """

    lengths: torch.Tensor
    spans: torch.Tensor
    present: torch.Tensor
    real: torch.Tensor
    input_bounds: torch.Tensor
    aligned_bounds: torch.Tensor
    sequence_length: int
    alignment: int

    @classmethod
    def build(
        cls, seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, alignment: int, sequence_length: int
    ) -> DocumentTable:
        lengths = seq_lens.to(torch.int64)
        spans = seq_lens_padded.to(torch.int64)
        present = lengths != 0
        # Clamping keeps the bounds sorted even for broken data, so that the
        # binary searches stay in range while the asserts report the rule;
        # past the row, one column more than the row tells as much as any
        # length (a valid document fits the row) and keeps the running sums
        # from wrapping int64 for lengths near its limit.
        real = torch.where(present, lengths, 0).clamp(0, sequence_length + 1)
        span = torch.where(present, spans, 0).clamp(0, sequence_length + 1)
        width = round_up(real, alignment)
        input_bounds = running_sum(F.pad(span, (1, 0)))
        aligned_bounds = running_sum(F.pad(width, (1, 0)))
        return cls(lengths, spans, present, real, input_bounds, aligned_bounds, sequence_length, alignment)

    def violations(self) -> torch.Tensor:
        """Bool ``[batch, documents, 4]``: which of the first four :func:`layout_rules` each document breaks.

        A document breaks the span rule when its span ends past the row,
        counting the spans of the present documents before it.
        """
        present = self.present
        absent_with_span = ~present & (self.spans != 0)
        negative = present & (self.lengths < 0)
        short_span = present & (self.spans < self.lengths)
        past_row = present & (self.input_bounds[:, 1:] > self.sequence_length)
        return torch.stack([absent_with_span, negative, short_span, past_row], dim=-1)

    def first_violations(self) -> torch.Tensor:
        """Bool ``[4]``: the rules broken by the first broken document (row-major), all False if none is."""
        per_document = F.pad(self.violations().flatten(0, 1), (0, 0, 0, 1))
        first = per_document.any(-1).to(torch.int8).argmax()
        return per_document.index_select(0, first.reshape(1)).squeeze(0)

    def longest(self) -> torch.Tensor:
        """0-d int64: the longest aligned row (0 without documents, and for an empty batch)."""
        return F.pad(self.aligned_bounds[:, -1], (0, 1)).max()

    def checked(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(longest, broken)``: :meth:`longest` and the flags of :func:`layout_rules` for a row of ``length``."""
        longest = self.longest()
        return longest, torch.cat([self.first_violations(), (longest > length).reshape(1)])


def _slots(bounds: torch.Tensor, starts: torch.Tensor, limit) -> torch.Tensor:
    """``[batch, len(starts)]``: the slot whose span holds each position of ``starts`` (1-d, int64, in ``[0, limit)``).

    ``bounds`` is ``[batch, documents + 1]`` running starts from 0, never
    decreasing. Slots of zero width are skipped (the search takes the last
    start at or before the position); positions at or past the row total
    get slot ``documents``. Bounds past ``limit`` are cut to it, which
    changes no comparison with a position and keeps the sum of every row's
    steps within int64 however long the (broken) spans are.
    """
    batch, width = bounds.shape
    bounds = bounds.clamp_max(limit)
    steps = torch.diff(bounds, dim=1, prepend=bounds[:, :1])  # bounds are these steps' running sums
    found = search_running_sums(steps, starts, right=True)
    rows = torch.arange(batch, device=bounds.device).unsqueeze(1)
    return (found - rows * width).clamp_max(width) - 1


def _aligned_layout_fake(
    seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, sequence_length: int, alignment: int, length: int
):
    """Three ``[B, length]`` tables, ``input_positions [B, S]``, the 0-d need, flags ``[5]`` (all int64 but flags)."""
    batch = seq_lens.shape[0]
    new = seq_lens.new_empty
    return (
        new(batch, length, dtype=torch.int64),
        new(batch, length, dtype=torch.int64),
        new(batch, length, dtype=torch.int64),
        new(batch, sequence_length, dtype=torch.int64),
        new((), dtype=torch.int64),
        new(5, dtype=torch.bool),
    )


class AlignedLayoutOutputs(NamedTuple):
    """Outputs of ``packfn::aligned_layout`` (int64 tables, see the layout format above)."""

    source_indices: torch.Tensor  # [batch, length]
    position_ids: torch.Tensor  # [batch, length]
    sequence_ids: torch.Tensor  # [batch, length]
    input_positions: torch.Tensor  # [batch, sequence_length]
    longest: torch.Tensor  # 0-d: the longest aligned row, the shortest row length that fits every row
    broken: torch.Tensor  # bool [5]: layout_rules


def layout_tables(
    table: DocumentTable, length: int, *, search_input: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``source_indices``, ``position_ids``, ``sequence_ids``, ``input_positions`` of ``table``'s layout.

    ``length`` is a multiple of ``alignment`` (callers check). With
    ``search_input`` each input column searches its document (the
    decomposition); without, ``input_positions`` is the inverse of
    ``source_indices`` (:func:`_inverse`, the eager kernel), which is the
    same wherever the layout rules hold.
    """
    real, input_bounds, aligned_bounds = table.real, table.input_bounds, table.aligned_bounds
    sequence_length, alignment = table.sequence_length, table.alignment
    batch, device = real.shape[0], real.device
    # Slot `documents` (past the last document) reads a real length of 0, so
    # every column it gets is padding.
    real = F.pad(real, (0, 1))

    # Aligned row: every document starts on a multiple of `alignment`, so
    # one binary search per block of `alignment` columns finds its slot, and
    # the columns inside a block follow by broadcasting (no per-column search
    # or gather).
    block_starts = torch.arange(0, length, alignment, device=device)
    slot = _slots(aligned_bounds, block_starts, length)
    first = block_starts - aligned_bounds.gather(1, slot)  # position in the document of the block's first column
    remaining = (real.gather(1, slot) - first).unsqueeze(-1)
    within = torch.arange(alignment, device=device)
    outside = within >= remaining
    # Each sum is its own output, masked in place: in eager on the CPU, fresh
    # pages of a large temporary cost more than the pass that fills them.
    source_first = (input_bounds.gather(1, slot) + first).unsqueeze(-1)
    source_indices = (source_first + within).masked_fill_(outside, -1).reshape(batch, length)
    position_ids = (first.unsqueeze(-1) + within).masked_fill_(outside, 0).reshape(batch, length)
    sequence_ids = torch.where(outside, 0, slot.unsqueeze(-1) + 1).reshape(batch, length)

    if search_input:
        # Input row: spans are not aligned, so each column searches its slot;
        # it is real up to the slot's start plus its real length and moves by
        # the slot's shift from input start to aligned start.
        columns = torch.arange(sequence_length, device=device)
        slot = _slots(input_bounds, columns, sequence_length)
        real_ends = F.pad(input_bounds[:, :-1], (0, 1)) + real
        shifts = aligned_bounds - input_bounds
        inside = columns < real_ends.gather(1, slot)
        input_positions = torch.where(inside, columns + shifts.gather(1, slot), -1)
    else:
        input_positions = _inverse(source_indices, sequence_length)
    return source_indices, position_ids, sequence_ids, input_positions


def _aligned_layout(
    seq_lens: torch.Tensor,
    seq_lens_padded: torch.Tensor,
    sequence_length: int,
    alignment: int,
    length: int,
    *,
    search_input: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    table = DocumentTable.build(seq_lens, seq_lens_padded, alignment, sequence_length)
    longest, broken = table.checked(length)
    tables = layout_tables(table, length, search_input=search_input)
    return (*tables, longest, broken)


def _inverse(source_indices: torch.Tensor, sequence_length: int) -> torch.Tensor:
    """``input_positions`` as the inverse of ``source_indices``: one indexed write, where the layout rules hold.

    Each aligned column holding a real token writes its column to that
    token's input column (NOTE [Why pack and restore are each other's
    backward]); every other aligned column writes -1 to the buffer's first
    entry, by a maximum, so it changes nothing there and no index leaves
    the buffer however broken the tables (and where they are broken, the
    result still does not depend on the order of the writes). The buffer is
    exactly the output. Few large temporaries: on the CPU, fresh pages cost
    more than the passes.
    """
    batch, length = source_indices.shape
    device = source_indices.device
    real = (source_indices >= 0) & (source_indices < sequence_length)
    rows = torch.arange(batch, device=device).unsqueeze(1) * sequence_length
    target = (source_indices + rows).masked_fill_(~real, 0)
    columns = torch.arange(length, device=device).expand(batch, length).masked_fill(~real, -1)
    inverse = source_indices.new_full((batch * sequence_length,), -1)
    if inverse.numel():  # an empty buffer has no first entry to take the other columns' writes (eager only)
        inverse.scatter_reduce_(0, target.reshape(-1), columns.reshape(-1), reduce="amax")
    return inverse.view(batch, sequence_length)


def _aligned_layout_eager(
    seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, sequence_length: int, alignment: int, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager kernel (NOTE [Eager kernels]): ``input_positions`` by one indexed write, not a search per column."""
    return _aligned_layout(seq_lens, seq_lens_padded, sequence_length, alignment, length, search_input=False)


@packfn_op(
    "aligned_layout",
    fake=_aligned_layout_fake,
    outputs=AlignedLayoutOutputs,
    eager=_aligned_layout_eager,
    gpu="layout_kernels",
)
def aligned_layout_op(
    seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, sequence_length: int, alignment: int, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _aligned_layout(seq_lens, seq_lens_padded, sequence_length, alignment, length, search_input=True)


# NOTE [Why pack and restore are each other's backward]
# pack reads row b, column j of its output from input column
# source_indices[b, j] (fill where it is -1); restore reads input column i
# from aligned column input_positions[b, i] (zero where it is -1). A layout
# maps its real tokens one to one, so the two index tables are inverse
# permutations on real tokens (source_indices[b, input_positions[b, i]] == i)
# and every other entry is -1. The gradient of a gather is the scatter-add
# of the output gradient back to the columns read; since each input column
# is read at most once, that scatter-add is itself a gather through the
# inverse table: d pack / d values = restore(grad) and
# d restore / d values = pack(grad, fill=0). Padding reads nothing, so it
# gets a zero gradient, and the fill value gets none. Both directions stay
# gathers: deterministic, no atomics, and Inductor fuses each into one
# loop. This relies on the two tables coming from one layout, which is why
# both ops take both tables.


def _trailing(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[B, width]`` as ``[B, width, 1, ...]``, to broadcast over ``values``' trailing axes."""
    return mask.reshape(*mask.shape, *([1] * (values.ndim - 2)))


def _nothing_to_read(values: torch.Tensor, index: torch.Tensor, fill: float) -> torch.Tensor:
    """What :func:`_gather_rows` gives from rows of no columns (every index -1): ``fill`` throughout.

    Gathering from an empty axis fails however the index is masked. Only a
    size known to be 0 takes this branch (dynamic shapes specialize 0), so it
    adds no guard: a size read from data (the drop-ins' packed rows) gathers.
    """
    return values.new_full((*index.shape, *values.shape[2:]), fill)


def _gather_rows(values: torch.Tensor, index: torch.Tensor, fill: float) -> torch.Tensor:
    """``[B, width, ...]``: ``values[b, index[b, j]]``, ``fill`` where ``index`` is negative.

    A gather along the sequence axis, the index broadcast over the trailing
    axes: one indirect load under Inductor. ``values`` is never reshaped:
    merging its batch and sequence axes makes the tracer guard on their
    product's divisibility (``2 % (2 * budget) != 0`` for a budget traced
    from the sequence), which a ``torch.export`` ``Dim`` cannot satisfy.
    """
    if statically_known_true(values.shape[1] == 0):
        return _nothing_to_read(values, index, fill)
    valid = index >= 0
    expanded = _trailing(index.clamp_min(0), values).expand(*index.shape, *values.shape[2:])
    return values.gather(1, expanded).masked_fill(~_trailing(valid, values), fill)


def _gather_rows_eager(values: torch.Tensor, index: torch.Tensor, fill: float) -> torch.Tensor:
    """:func:`_gather_rows` as one flat row gather: a contiguous copy per token row, faster in eager."""
    batch, source = values.shape[:2]
    if source == 0:
        return _nothing_to_read(values, index, fill)
    offsets = torch.arange(batch, device=index.device).unsqueeze(1) * source
    flat = (index.clamp_min(0) + offsets).reshape(-1)
    gathered = values.flatten(0, 1).index_select(0, flat).unflatten(0, tuple(index.shape))
    return gathered.masked_fill(~_trailing(index >= 0, values), fill)


def _pack_eager(
    values: torch.Tensor, source_indices: torch.Tensor, input_positions: torch.Tensor, fill: float
) -> torch.Tensor:
    return _gather_rows_eager(values, source_indices, fill)


def _restore_eager(values: torch.Tensor, input_positions: torch.Tensor, source_indices: torch.Tensor) -> torch.Tensor:
    return _gather_rows_eager(values, input_positions, 0.0)


def _pack_fake(values: torch.Tensor, source_indices: torch.Tensor, input_positions: torch.Tensor, fill: float):
    """``[batch, length, ...]`` in values' dtype."""
    return values.new_empty((values.shape[0], source_indices.shape[1], *values.shape[2:]))


def _restore_fake(values: torch.Tensor, input_positions: torch.Tensor, source_indices: torch.Tensor):
    """``[batch, sequence, ...]`` in values' dtype."""
    return values.new_empty((values.shape[0], input_positions.shape[1], *values.shape[2:]))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])


def _pack_backward(ctx, grad: torch.Tensor):
    source_indices, input_positions = ctx.saved_tensors
    return restore_op(grad, input_positions, source_indices), None, None, None


def _restore_backward(ctx, grad: torch.Tensor):
    input_positions, source_indices = ctx.saved_tensors
    return pack_op(grad, source_indices, input_positions, 0.0), None, None


@packfn_op("pack", fake=_pack_fake, eager=_pack_eager, backward=_pack_backward, setup_context=_setup_context)
def pack_op(
    values: torch.Tensor, source_indices: torch.Tensor, input_positions: torch.Tensor, fill: float
) -> torch.Tensor:
    return _gather_rows(values, source_indices, fill)


@packfn_op(
    "restore", fake=_restore_fake, eager=_restore_eager, backward=_restore_backward, setup_context=_setup_context
)
def restore_op(values: torch.Tensor, input_positions: torch.Tensor, source_indices: torch.Tensor) -> torch.Tensor:
    return _gather_rows(values, input_positions, 0.0)
