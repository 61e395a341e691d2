"""Triton kernels for the ops that parse a mask (or batch-major metadata), convert a format to one, pad, or build an
aligned layout, on CUDA.

NOTE [Two launches on a GPU]
Written as aten ops, a mask parse is a chain of scans, scatters, reductions
and their memsets, and Inductor cannot fuse across a scan or a scatter:
``varlen_metadata`` and ``batch_metadata`` launched 16 kernels each,
``flatten_metadata`` 13 and ``thd_metadata`` 25 at 8 x 32768 in the code
Inductor writes for an H200, where reading the mask once takes well under
a microsecond, so their time was launch latency. On CUDA, these four and
``physical_varlen_metadata`` run these kernels instead, one program per
row, each walking its row in blocks of ``BLOCK`` columns with a few
running values carried from block to block (``packed_position_ids``, 7
launches before, needs only the one pass of ``_position_rows``):

1. ``_row_stats`` (``_segment_stats``, ``_flatten_stats``): each row's
   valid tokens, documents, longest document and rule flags (``[batch,
   STATS]`` int64; segments and the longest for the physical op; for
   flatten, a row of batch-major metadata and its last boundary);
2. ``_varlen_rows``, ``_batch_rows``, ``_thd_rows`` (``_segment_rows``,
   ``_flatten_rows``): the row again, now knowing the rows before it from
   (1), writing every output once: the valid-first permutation, the
   boundaries and lengths of each document, the slots past the last
   document; program 0 writes the totals.

``mask_flags``, the rule check of the block masks, is (1) alone on CUDA.
The conversions to a mask need one pass: ``_position_id_rows`` (position
ids), ``_eos_rows`` (marker tokens, with positions and a loss mask; up to
``EOS_MARKERS`` markers, more take the aten body), ``_length_rows``
(``seq_lens``: each row's running sums of its lengths, written once, then a
binary search per column, ``_at_or_before``) and ``_boundary_rows``
(``cu_seqlens``, flat or a table a row: a binary search per column of the
table as the aten body reads it), where the aten bodies launched 6 to 17
kernels (a split scan and its memset per running sum, a scatter and its
init per boundary count).
``document_block_tables`` (``document_block_mask``'s op) takes each block's
summary from one reduction by aten, then ``_block_tables``, one program per
block, writes all eight tables of a ``BlockMask``: the key blocks each query
block sees, and the query blocks that see each key block, partial and
full, each ordered as ``create_block_mask`` orders them, where the aten
body sorts four ``[B, 1, Q, K]`` tables and ``BlockMask.from_kv_blocks``
derived the query side in ten launches more (``document_block_mask``: 4
launches with its rule check, where it launched 16). ``pad`` is one kernel,
``_pad_rows``, one program per ``PAD_BLOCK`` positions: each position's
row by a binary search over the valid positions (``_at_or_before``), the
rule check and the rows' move, where the aten body launched four.
``aligned_layout`` is one kernel, ``_layout_rows``, one program per row: the
row's document ends in the input row and in the aligned row (written once,
as ``_length_rows`` writes its ends), the first broken document's rules,
then each aligned column's document and each input column's by a binary
search over those ends; one reduction over the rows keeps the first broken
row's rules and the longest aligned row (2 launches with its rule check,
where the aten body launched 15: the tables' clamps and running sums, a
search per table, the checks' reductions).

The rule flags are reduced from (1) by aten, one small reduction per rule,
so that Inductor fuses them with the public function's asserts into one
kernel (``assert_rules`` reads the flags as the bits of one integer: asserts
reading different elements of a flags tensor a kernel wrote are a kernel
each): compiled, ``varlen_metadata`` and ``thd_metadata`` launch 3 kernels,
``batch_metadata`` and ``flatten_metadata`` 4 (the last their maximum over
the documents' lengths), ``physical_varlen_metadata`` and
``packed_position_ids`` 2, where SPEC section 6 allows 4
(``tests/core/test_triton_rows.py`` holds every count). No output needs a
memset (every slot is written by exactly one program) and nothing is read
back to the host, so the launches go into a CUDA graph. A block finds its
documents as the eager kernels do: with a running maximum of the ids before
each column (``tl.associative_scan``), a valid id that differs from it
starts a document and one below it breaks the order rule.

The loads of the mask sit in the kernels' bodies, never in a helper: torch
learns which arguments a user-defined kernel writes by following each
store's address back through the ops that make it (past loads, but through
a call to every argument of the call), and a mask counted as written is
cloned by Inductor wherever it is read again.

The aten bodies stay: they are the op on every other device, the
decomposition ``torch.export`` records, and the reference the kernels are
tested against. ``tests/core/test_triton_rows.py`` runs these kernels on
the CPU through Triton's interpreter (``TRITON_INTERPRET=1``) against them
on generated masks, and ``scripts/inductor_cuda.py`` counts their launches
in the code Inductor writes for an H200. Under ``torch.compile`` Inductor
emits the kernels as they are (user-defined Triton kernels), with no call
back into ``packfn::``. The kernels' speed has not been measured: no GPU was
at hand when they were written (``scripts/gpu_check.py`` times them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from packfn._ops import formats as format_ops
from packfn._ops import varlen as varlen_ops
from packfn._ops.masks import block_summaries
from packfn._ops.metadata import mask_flags

__all__ = [
    "batch_kernels",
    "block_tables_kernels",
    "cu_seqlens_kernels",
    "eos_kernels",
    "flatten_kernels",
    "layout_kernels",
    "mask_flags_kernels",
    "pad_kernels",
    "physical_varlen_kernels",
    "position_id_kernels",
    "position_kernels",
    "seq_lens_kernels",
    "thd_kernels",
    "varlen_kernels",
]

BLOCK = 1024  # columns a program reads at a time
ROWS = 128  # rows a program sums at a time to learn the rows before it
CHUNK = 1024  # blocks a program of _block_tables reads at a time
STATS = 6  # valid tokens, documents, longest document, a negative id, a decrease, a gap in a document
FLATTEN_STATS = 7  # valid tokens, documents, last boundary, the four FLATTEN_RULES


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _running_sum(values):
    # tl.cumsum, spelled as the scan it is: Triton 3.6's interpreter cannot call tl.cumsum from a helper.
    return tl.associative_scan(values, 0, _add)


@triton.jit
def _clamped(value, sequence):
    """``value`` clamped to ``[0, sequence + 1]`` in int64, as the aten bodies clamp a length (``sequence + 1`` in
    the int32 Triton takes ``sequence`` as would wrap at ``2**31 - 1``)."""
    return tl.minimum(tl.maximum(value, 0), tl.full((), 0, tl.int64) + sequence + 1)


@triton.jit
def _top_two(first_a, second_a, first_b, second_b):
    # The two largest of a multiset, merged: associative, so a scan can use it.
    return tl.maximum(first_a, first_b), tl.maximum(tl.minimum(first_a, first_b), tl.maximum(second_a, second_b))


@triton.jit
def _documents(value, left, last_id, seen):
    """A block's valid and start flags and each column's valid tokens before it, from its ids and their left ones.

    Takes values, never a pointer: torch reads which arguments a kernel writes
    by following each store's address back through the ops that make it, and
    through a call to every argument of the call, so a helper that loaded
    the mask itself would have it counted as written (and cloned by Inductor
    wherever the mask is used again).
    """
    # The largest id before each column (0 before the first): the previous
    # valid id wherever ids never decrease.
    earlier = tl.maximum(tl.associative_scan(left, 0, _maximum), last_id)
    valid = value != 0
    starts = valid & (value != earlier)
    count = valid.to(tl.int64)
    rank = seen + _running_sum(count) - count
    return earlier, valid, starts, rank


@triton.jit
def _row_stats(ids, stats, sequence, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ids += row * sequence
    zero = tl.full((), 0, tl.int64)
    last_id, seen, documents, start, longest, negative, decrease, gap = (
        zero,
        zero,
        zero,
        zero - 1,
        zero,
        zero,
        zero,
        zero,
    )
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        value = tl.load(ids + column, mask=column < sequence, other=0).to(tl.int64)
        left = tl.load(ids + column - 1, mask=(column < sequence) & (column > 0), other=0).to(tl.int64)
        earlier, valid, starts, rank = _documents(value, left, last_id, seen)
        # Each valid token's document began at the latest start at or before it.
        began = tl.maximum(tl.associative_scan(tl.where(starts, rank, -1), 0, _maximum), start)
        longest = tl.maximum(longest, tl.max(tl.where(valid, rank - began + 1, 0), 0))
        negative = tl.maximum(negative, tl.max((value < 0).to(tl.int64), 0))
        decrease = tl.maximum(decrease, tl.max((valid & (value < earlier)).to(tl.int64), 0))
        # A document's token after padding (THD's rule): valid, no start, its left neighbour padding.
        gap = tl.maximum(gap, tl.max((valid & ~starts & (left == 0) & (column > 0)).to(tl.int64), 0))
        start = tl.max(began, 0)
        last_id = tl.maximum(last_id, tl.max(value, 0))
        seen += tl.sum(valid.to(tl.int64), 0)
        documents += tl.sum(starts.to(tl.int64), 0)
    stats += row * 6  # STATS
    tl.store(stats + 0, seen)
    tl.store(stats + 1, documents)
    tl.store(stats + 2, longest)
    tl.store(stats + 3, negative)
    tl.store(stats + 4, decrease)
    tl.store(stats + 5, gap)


@triton.jit
def _rows_before(stats, batch, row, ROWS: tl.constexpr):
    """Valid tokens and documents in the rows before ``row`` and in all rows, and the longest document."""
    zero = tl.full((), 0, tl.int64)
    valid_before, documents_before, valid_total, documents_total, longest = zero, zero, zero, zero, zero
    for first in range(0, batch, ROWS):
        rows = first + tl.arange(0, ROWS)
        seen = tl.load(stats + rows * 6 + 0, mask=rows < batch, other=0)
        documents = tl.load(stats + rows * 6 + 1, mask=rows < batch, other=0)
        valid_before += tl.sum(tl.where(rows < row, seen, 0), 0)
        documents_before += tl.sum(tl.where(rows < row, documents, 0), 0)
        valid_total += tl.sum(seen, 0)
        documents_total += tl.sum(documents, 0)
        longest = tl.maximum(longest, tl.max(tl.load(stats + rows * 6 + 2, mask=rows < batch, other=0), 0))
    return valid_before, documents_before, valid_total, documents_total, longest


@triton.jit
def _varlen_rows(
    ids,
    stats,
    indices,
    cu_seqlens,
    seqlens,
    max_seqlen,
    num_tokens,
    num_documents,
    batch,
    sequence,
    max_documents,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    valid_before, documents_before, valid_total, documents_total, longest = _rows_before(stats, batch, row, ROWS)
    capacity = batch * max_documents  # document slots; cu_seqlens has one more
    padding_before = row * sequence - valid_before
    ids += row * sequence
    zero = tl.full((), 0, tl.int64)
    last_id, seen, documents, start = zero, zero, zero, zero - 1
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        value = tl.load(ids + column, mask=inside, other=0).to(tl.int64)
        left = tl.load(ids + column - 1, mask=inside & (column > 0), other=0).to(tl.int64)
        _, valid, starts, rank = _documents(value, left, last_id, seen)
        # Valid tokens first in order, then the padding in order.
        slot = tl.where(valid, valid_before + rank, valid_total + padding_before + column - rank)
        tl.store(indices + slot, row * sequence + column, mask=inside)
        # Document k of the batch starts at its start's valid rank.
        document = documents_before + documents + _running_sum(starts.to(tl.int64)) - 1
        tl.store(cu_seqlens + document, (valid_before + rank).to(tl.int32), mask=starts & (document <= capacity))
        # At each start, the previous start of the row (the second largest start rank so far) ends a document.
        first, second = tl.associative_scan((tl.where(starts, rank, -1), tl.full((BLOCK,), -1, tl.int64)), 0, _top_two)
        previous = tl.maximum(second, start)
        tl.store(
            seqlens + document - 1,
            (rank - previous).to(tl.int32),
            mask=starts & (previous >= 0) & (document - 1 < capacity),
        )
        start = tl.maximum(start, tl.max(first, 0))
        last_id = tl.maximum(last_id, tl.max(value, 0))
        seen += tl.sum(valid.to(tl.int64), 0)
        documents += tl.sum(starts.to(tl.int64), 0)
    # The row's last document ends with its last valid token.
    last = documents_before + documents - 1
    tl.store(seqlens + last, (seen - start).to(tl.int32), mask=(documents > 0) & (last < capacity))
    # Slots past the batch's documents: cu_seqlens holds the token count, seqlens 0. Row r fills slots r*D to r*D+D-1.
    for offset in range(0, max_documents, BLOCK):
        slot = row * max_documents + offset + tl.arange(0, BLOCK)
        spare = (offset + tl.arange(0, BLOCK) < max_documents) & (slot >= documents_total)
        tl.store(cu_seqlens + slot, valid_total.to(tl.int32), mask=spare)
        tl.store(seqlens + slot, tl.full((BLOCK,), 0, tl.int32), mask=spare)
    tl.store(cu_seqlens + capacity, valid_total.to(tl.int32), mask=(row == batch - 1) & (capacity >= documents_total))
    if row == 0:
        tl.store(max_seqlen, longest.to(tl.int32))
        tl.store(num_tokens, valid_total)
        tl.store(num_documents, documents_total)


@triton.jit
def _batch_rows(
    ids,
    stats,
    packed_token_indices,
    cu_seqlens,
    row_max_seqlen,
    num_documents,
    batch,
    sequence,
    max_documents,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ids += row * sequence
    packed_token_indices += row * sequence
    cu_seqlens += row * (max_documents + 1)
    zero = tl.full((), 0, tl.int64)
    last_id, seen, documents = zero, zero, zero
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        value = tl.load(ids + column, mask=inside, other=0).to(tl.int64)
        left = tl.load(ids + column - 1, mask=inside & (column > 0), other=0).to(tl.int64)
        _, valid, starts, rank = _documents(value, left, last_id, seen)
        tl.store(packed_token_indices + column, tl.where(valid, column, -1), mask=inside)
        document = documents + _running_sum(starts.to(tl.int64)) - 1
        tl.store(cu_seqlens + document, rank.to(tl.int32), mask=starts & (document <= max_documents))
        last_id = tl.maximum(last_id, tl.max(value, 0))
        seen += tl.sum(valid.to(tl.int64), 0)
        documents += tl.sum(starts.to(tl.int64), 0)
    # After the last document its end, then -1 in every unused slot.
    for offset in range(0, max_documents + 1, BLOCK):
        slot = offset + tl.arange(0, BLOCK)
        tail = tl.where(slot == documents, seen, -1).to(tl.int32)
        tl.store(cu_seqlens + slot, tail, mask=(slot <= max_documents) & (slot >= documents))
    tl.store(row_max_seqlen + row, tl.load(stats + row * 6 + 2).to(tl.int32))
    tl.store(num_documents + row, documents)


@triton.jit
def _thd_rows(
    ids,
    stats,
    cu_seqlens,
    cu_seqlens_padded,
    batch,
    sequence,
    max_documents,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    valid_before, documents_before, valid_total, documents_total, _longest = _rows_before(stats, batch, row, ROWS)
    capacity = batch * max_documents  # document slots; each output has one more
    tokens = batch * sequence
    ids += row * sequence
    zero = tl.full((), 0, tl.int64)
    last_id, seen, documents = zero, zero, zero
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        value = tl.load(ids + column, mask=inside, other=0).to(tl.int64)
        left = tl.load(ids + column - 1, mask=inside & (column > 0), other=0).to(tl.int64)
        _, valid, starts, rank = _documents(value, left, last_id, seen)
        document = documents_before + documents + _running_sum(starts.to(tl.int64)) - 1
        keep = starts & (document <= capacity)
        tl.store(cu_seqlens + document, (valid_before + rank).to(tl.int32), mask=keep)
        # Each document's first token in the flat batch; the first span starts at 0 whatever the mask.
        tl.store(
            cu_seqlens_padded + document, tl.where(document == 0, 0, row * sequence + column).to(tl.int32), mask=keep
        )
        last_id = tl.maximum(last_id, tl.max(value, 0))
        seen += tl.sum(valid.to(tl.int64), 0)
        documents += tl.sum(starts.to(tl.int64), 0)
    # Slots past the batch's documents: the token counts (slot 0 of the spans stays 0). Row r fills r*D to r*D+D-1.
    for offset in range(0, max_documents, BLOCK):
        slot = row * max_documents + offset + tl.arange(0, BLOCK)
        spare = (offset + tl.arange(0, BLOCK) < max_documents) & (slot >= documents_total)
        tl.store(cu_seqlens + slot, valid_total.to(tl.int32), mask=spare)
        tl.store(cu_seqlens_padded + slot, tl.where(slot == 0, 0, tokens).to(tl.int32), mask=spare)
    last = (row == batch - 1) & (capacity >= documents_total)
    tl.store(cu_seqlens + capacity, valid_total.to(tl.int32), mask=last)
    tl.store(cu_seqlens_padded + capacity, tokens.to(tl.int32), mask=last)


@triton.jit
def _segment_starts(value, left, column):
    """Where a segment (a run of equal ids, or the row's first column) starts; values only, as for _documents."""
    return (value != left) | (column == 0)


@triton.jit
def _segment_stats(ids, stats, sequence, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ids += row * sequence
    zero = tl.full((), 0, tl.int64)
    segments, start, longest = zero, zero, zero
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        value = tl.load(ids + column, mask=inside, other=0).to(tl.int64)
        left = tl.load(ids + column - 1, mask=inside & (column > 0), other=0).to(tl.int64)
        starts = inside & _segment_starts(value, left, column)
        began = tl.maximum(tl.associative_scan(tl.where(starts, column, -1), 0, _maximum), start)
        longest = tl.maximum(longest, tl.max(tl.where(column < sequence, column - began + 1, 0), 0))
        start = tl.max(began, 0)
        segments += tl.sum(starts.to(tl.int64), 0)
    tl.store(stats + row * 2, segments)
    tl.store(stats + row * 2 + 1, longest)


@triton.jit
def _segment_rows(
    ids, stats, cu_seqlens, max_seqlen, num_segments, batch, sequence, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    zero = tl.full((), 0, tl.int64)
    before, total, longest = zero, zero, zero
    for first in range(0, batch, ROWS):
        rows = first + tl.arange(0, ROWS)
        segments = tl.load(stats + rows * 2, mask=rows < batch, other=0)
        before += tl.sum(tl.where(rows < row, segments, 0), 0)
        total += tl.sum(segments, 0)
        longest = tl.maximum(longest, tl.max(tl.load(stats + rows * 2 + 1, mask=rows < batch, other=0), 0))
    tokens = batch * sequence
    ids += row * sequence
    seen = zero
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        value = tl.load(ids + column, mask=inside, other=0).to(tl.int64)
        left = tl.load(ids + column - 1, mask=inside & (column > 0), other=0).to(tl.int64)
        starts = inside & _segment_starts(value, left, column)
        segment = before + seen + _running_sum(starts.to(tl.int64)) - 1
        tl.store(cu_seqlens + segment, (row * sequence + column).to(tl.int32), mask=starts)
        seen += tl.sum(starts.to(tl.int64), 0)
    # Slots past the last segment hold the token count. Row r fills slots r*S to r*S+S-1, the last row the last slot.
    for offset in range(0, sequence, BLOCK):
        slot = row * sequence + offset + tl.arange(0, BLOCK)
        spare = (offset + tl.arange(0, BLOCK) < sequence) & (slot >= total)
        tl.store(cu_seqlens + slot, tl.full((BLOCK,), 0, tl.int32) + tokens.to(tl.int32), mask=spare)
    tl.store(cu_seqlens + tokens, tokens.to(tl.int32), mask=row == batch - 1)
    if row == 0:
        tl.store(max_seqlen, longest.to(tl.int32))
        tl.store(num_segments, total)


@triton.jit
def _column_before(stats, column, batch, row, WIDTH: tl.constexpr, ROWS: tl.constexpr):
    """The sum of one column of ``[batch, WIDTH]`` stats over the rows before ``row``, and over all rows."""
    zero = tl.full((), 0, tl.int64)
    before, total = zero, zero
    for first in range(0, batch, ROWS):
        rows = first + tl.arange(0, ROWS)
        values = tl.load(stats + rows * WIDTH + column, mask=rows < batch, other=0)
        before += tl.sum(tl.where(rows < row, values, 0), 0)
        total += tl.sum(values, 0)
    return before, total


@triton.jit
def _flatten_stats(tokens, bounds, stats, sequence, slots, BLOCK: tl.constexpr):
    """Per row of batch-major metadata: valid tokens, documents, the last boundary, and the four FLATTEN_RULES."""
    row = tl.program_id(0).to(tl.int64)
    tokens += row * sequence
    bounds += row * slots
    zero = tl.full((), 0, tl.int64)
    valid_tokens, count, gaps, decrease, after_gap = zero, zero, zero, zero, zero
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        value = tl.load(tokens + column, mask=inside, other=0).to(tl.int64)
        valid_tokens += tl.sum((inside & (value >= 0)).to(tl.int64), 0)
    for begin in range(0, slots, BLOCK):
        slot = begin + tl.arange(0, BLOCK)
        inside = slot < slots
        bound = tl.load(bounds + slot, mask=inside, other=0).to(tl.int64)
        left = tl.load(bounds + slot - 1, mask=inside & (slot > 0), other=-1).to(tl.int64)
        valid = inside & (bound >= 0)
        missing = (inside & (bound < 0)).to(tl.int64)
        # A boundary after a -1 entry: the -1 entries up to it (it is none of them) outnumber none.
        after_gap = tl.maximum(after_gap, tl.max((valid & (gaps + _running_sum(missing) > 0)).to(tl.int64), 0))
        decrease = tl.maximum(decrease, tl.max((valid & (left >= 0) & (bound < left)).to(tl.int64), 0))
        gaps += tl.sum(missing, 0)
        count += tl.sum(valid.to(tl.int64), 0)
    first = tl.load(bounds).to(tl.int64)
    documents = tl.maximum(count - 1, 0)
    last = tl.load(bounds + documents).to(tl.int64)  # as the aten body reads it: at the count of boundaries, less one
    stats += row * 7  # FLATTEN_STATS
    tl.store(stats + 0, valid_tokens)
    tl.store(stats + 1, documents)
    tl.store(stats + 2, last)
    tl.store(stats + 3, (first != 0).to(tl.int64))
    tl.store(stats + 4, decrease)
    tl.store(stats + 5, after_gap)
    tl.store(stats + 6, (last != valid_tokens).to(tl.int64))


@triton.jit
def _flatten_rows(
    tokens,
    bounds,
    stats,
    indices,
    cu_seqlens,
    num_tokens,
    num_documents,
    batch,
    sequence,
    slots,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    valid_before, valid_total = _column_before(stats, 0, batch, row, 7, ROWS)  # FLATTEN_STATS
    documents_before, documents_total = _column_before(stats, 1, batch, row, 7, ROWS)
    tokens_before, tokens_total = _column_before(stats, 2, batch, row, 7, ROWS)
    documents = tl.load(stats + row * 7 + 1)
    padding_before = row * sequence - valid_before
    tokens += row * sequence
    bounds += row * slots
    seen = tl.full((), 0, tl.int64)
    # The valid tokens' flat positions first, in order, then the padding positions in order.
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        value = tl.load(tokens + column, mask=inside, other=0).to(tl.int64)
        valid = inside & (value >= 0)
        count = valid.to(tl.int64)
        rank = seen + _running_sum(count) - count
        slot = tl.where(valid, valid_before + rank, valid_total + padding_before + column - rank)
        tl.store(indices + slot, row * sequence + tl.where(valid, value, column), mask=inside)
        seen += tl.sum(count, 0)
    # Document j of the row ends at slot documents_before + j of the flat boundaries, offset by the tokens before.
    element = cu_seqlens.dtype.element_ty
    for begin in range(0, slots, BLOCK):
        local = begin + tl.arange(0, BLOCK)
        ours = (local >= 1) & (local <= documents)
        bound = tl.load(bounds + local, mask=ours, other=0).to(tl.int64)
        tl.store(cu_seqlens + documents_before + local, (tokens_before + bound).to(element), mask=ours)
    # Slots past the batch's documents hold the token count. Row r fills slots r*D+1 to r*D+D; program 0 slot 0.
    for offset in range(0, slots - 1, BLOCK):
        slot = row * (slots - 1) + 1 + offset + tl.arange(0, BLOCK)
        spare = (offset + tl.arange(0, BLOCK) < slots - 1) & (slot > documents_total)
        tl.store(cu_seqlens + slot, (tl.full((BLOCK,), 0, tl.int64) + tokens_total).to(element), mask=spare)
    if row == 0:
        tl.store(cu_seqlens, tl.full((), 0, tl.int64).to(element))
        tl.store(num_tokens, tokens_total)
        tl.store(num_documents, documents_total)


@triton.jit
def _positions(value, left, column, last_id, seen, first_seen, last_valid):
    """A block's positions (NOTE [Position ids by two running maxima]) from its ids and their left ones, with its
    ``_documents`` and the carries updated (values only, as in ``_documents``)."""
    earlier, valid, starts, rank = _documents(value, left, last_id, seen)
    counted = rank + valid.to(tl.int64)  # valid tokens up to and with each column
    # The count at the latest document start, and the latest valid column, at or before each column.
    first_seen = tl.maximum(tl.associative_scan(tl.where(starts, counted, 0), 0, _maximum), first_seen)
    last_valid = tl.maximum(tl.associative_scan(tl.where(valid, column, -1), 0, _maximum), last_valid)
    # A valid token: its rank in its document. Padding continues the count before it, or counts from 0.
    position = tl.where(counted > 0, counted - first_seen + column - last_valid, column)
    return position, earlier, valid, tl.max(first_seen, 0), tl.max(last_valid, 0)


@triton.jit
def _position_rows(ids, positions, stats, sequence, BLOCK: tl.constexpr):
    """Each token's position in its document (NOTE [Position ids by two running maxima]), and the row's flags."""
    row = tl.program_id(0).to(tl.int64)
    ids += row * sequence
    positions += row * sequence
    zero = tl.full((), 0, tl.int64)
    last_id, seen, first_seen, last_valid, negative, decrease = zero, zero, zero, zero - 1, zero, zero
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        value = tl.load(ids + column, mask=inside, other=0).to(tl.int64)
        left = tl.load(ids + column - 1, mask=inside & (column > 0), other=0).to(tl.int64)
        position, earlier, valid, first_seen, last_valid = _positions(
            value, left, column, last_id, seen, first_seen, last_valid
        )
        tl.store(positions + column, position, mask=inside)
        negative = tl.maximum(negative, tl.max((value < 0).to(tl.int64), 0))
        decrease = tl.maximum(decrease, tl.max((valid & (value < earlier)).to(tl.int64), 0))
        last_id = tl.maximum(last_id, tl.max(value, 0))
        seen += tl.sum(valid.to(tl.int64), 0)
    tl.store(stats + row * 2, negative)
    tl.store(stats + row * 2 + 1, decrease)


# ------------------------------------------------------------------ block tables


@triton.jit
def _block_pairs(
    q, kv, q_first_id, q_first, q_last, q_uniform, q_valid, kv_last_id, kv_first, kv_last, kv_uniform,
    block_size, window, WINDOW: tl.constexpr, SEPARATE: tl.constexpr,
):  # fmt: skip
    """Whether query block ``q`` sees key block ``kv`` in part, and in full: ``block_pairs``' rule, on values."""
    shared = kv_last_id == q_first_id
    reach = (kv < q) & shared
    full = (q_uniform != 0) & (kv_uniform != 0) & shared & ((kv + 1) * block_size <= q * block_size + 1)
    if WINDOW:
        reach = reach & (q_first - kv_last < window)
        full = full & (q_last - kv_first < window)
    present = reach | ((kv == q) & (q_valid != 0))
    if SEPARATE:
        return present & ~full, full
    return present, full & False


@triton.jit
def _store_ordered(table, present, seen, count, j, write):
    """Blocks ``j`` into their slots of an ordered table row: those ``present`` first, ascending, then the others,
    ``seen`` present ones and ``count`` in all before; returns ``seen`` past these."""
    flags = present.to(tl.int64)
    before = seen + _running_sum(flags) - flags
    tl.store(table + tl.where(flags != 0, before, count + j - before), j.to(tl.int32), mask=write)
    return seen + tl.sum(flags, 0)


@triton.jit
def _block_tables(
    summaries,
    kv_num_blocks,
    kv_indices,
    full_kv_num_blocks,
    full_kv_indices,
    q_num_blocks,
    q_indices,
    full_q_num_blocks,
    full_q_indices,
    blocks,
    block_size,
    window,
    WINDOW: tl.constexpr,
    SEPARATE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program ``b * blocks + i``: the key blocks of query block ``i`` and the query blocks of key block ``i``,
    partial and full, each table ordered as ``create_block_mask`` orders it."""
    program = tl.program_id(0).to(tl.int64)
    i = program % blocks
    # summaries: int64 [batch, 6, blocks] (block_summaries).
    base = summaries + (program - i) * 6
    first_id = tl.load(base + i)
    last_id = tl.load(base + blocks + i)
    first = tl.load(base + 2 * blocks + i)
    last = tl.load(base + 3 * blocks + i)
    uniform = tl.load(base + 4 * blocks + i)
    valid = tl.load(base + 5 * blocks + i)
    row = program * blocks
    kv_count = tl.zeros((), tl.int64)
    full_kv_count = tl.zeros((), tl.int64)
    q_count = tl.zeros((), tl.int64)
    full_q_count = tl.zeros((), tl.int64)
    # Step 0 counts each table's present blocks; step 1, knowing them, writes every slot once.
    for step in range(2):
        kv_seen = tl.zeros((), tl.int64)
        full_kv_seen = tl.zeros((), tl.int64)
        q_seen = tl.zeros((), tl.int64)
        full_q_seen = tl.zeros((), tl.int64)
        for begin in range(0, blocks, CHUNK):
            j = begin + tl.arange(0, CHUNK).to(tl.int64)
            inside = j < blocks
            write = inside & (step == 1)
            j_first_id = tl.load(base + j, mask=inside, other=-1)
            j_last_id = tl.load(base + blocks + j, mask=inside, other=-1)
            j_first = tl.load(base + 2 * blocks + j, mask=inside, other=0)
            j_last = tl.load(base + 3 * blocks + j, mask=inside, other=0)
            j_uniform = tl.load(base + 4 * blocks + j, mask=inside, other=0)
            j_valid = tl.load(base + 5 * blocks + j, mask=inside, other=0)
            kv_partial, kv_full = _block_pairs(
                i, j, first_id, first, last, uniform, valid, j_last_id, j_first, j_last, j_uniform,
                block_size, window, WINDOW, SEPARATE,
            )  # fmt: skip
            q_partial, q_full = _block_pairs(
                j, i, j_first_id, j_first, j_last, j_uniform, j_valid, last_id, first, last, uniform,
                block_size, window, WINDOW, SEPARATE,
            )  # fmt: skip
            kv_seen = _store_ordered(kv_indices + row, kv_partial & inside, kv_seen, kv_count, j, write)
            full_kv_seen = _store_ordered(
                full_kv_indices + row, kv_full & inside, full_kv_seen, full_kv_count, j, write
            )
            q_seen = _store_ordered(q_indices + row, q_partial & inside, q_seen, q_count, j, write)
            full_q_seen = _store_ordered(full_q_indices + row, q_full & inside, full_q_seen, full_q_count, j, write)
        kv_count = kv_seen
        full_kv_count = full_kv_seen
        q_count = q_seen
        full_q_count = full_q_seen
    tl.store(kv_num_blocks + program, kv_count.to(tl.int32))
    tl.store(full_kv_num_blocks + program, full_kv_count.to(tl.int32))
    tl.store(q_num_blocks + program, q_count.to(tl.int32))
    tl.store(full_q_num_blocks + program, full_q_count.to(tl.int32))


# ------------------------------------------------------------------ conversions


@triton.jit
def _eos_rows(
    tokens,
    mask,
    documents,
    positions,
    loss_mask,
    stats,
    sequence,
    pad,
    vocab_size,
    marker_0,
    marker_1,
    marker_2,
    marker_3,
    MARKERS: tl.constexpr,
    BOS: tl.constexpr,
    MASKED: tl.constexpr,
    PAD: tl.constexpr,
    VOCAB: tl.constexpr,
    RESET_POSITIONS: tl.constexpr,
    RESET_DOCUMENTS: tl.constexpr,
    EOD_MASK_LOSS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``document_ids_from_eos``: a row's documents between its markers (``BOS``: a marker begins one, else it
    ends one), their positions, the loss mask, and whether a token lies outside the vocabulary (``VOCAB``: 0 no
    vocabulary, 1 one the dtype cannot reach, so only a negative token is outside; 2 both bounds)."""
    row = tl.program_id(0).to(tl.int64)
    tokens += row * sequence
    zero = tl.full((), 0, tl.int64)
    markers_before, last_id, seen, first_seen, last_valid, outside = zero, zero, zero, zero, zero - 1, zero
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        token = tl.load(tokens + column, mask=inside, other=0)
        left_token = tl.load(tokens + column - 1, mask=inside & (column > 0), other=0)
        marker = tl.zeros((BLOCK,), tl.int1)
        left_marker = tl.zeros((BLOCK,), tl.int1)
        if MARKERS > 0:
            marker = marker | (token == marker_0)
            left_marker = left_marker | (left_token == marker_0)
        if MARKERS > 1:
            marker = marker | (token == marker_1)
            left_marker = left_marker | (left_token == marker_1)
        if MARKERS > 2:
            marker = marker | (token == marker_2)
            left_marker = left_marker | (left_token == marker_2)
        if MARKERS > 3:
            marker = marker | (token == marker_3)
            left_marker = left_marker | (left_token == marker_3)
        left_marker = left_marker & (column > 0)
        valid = inside
        left_valid = inside & (column > 0)
        if MASKED:
            valid = valid & (tl.load(mask + row * sequence + column, mask=inside, other=0) != 0)
            left_mask = mask + row * sequence + column - 1
            left_valid = left_valid & (tl.load(left_mask, mask=inside & (column > 0), other=0) != 0)
        if PAD:
            valid = valid & (token != pad)
            left_valid = left_valid & (left_token != pad)
        # Each column's document, counted over the whole row, and the one to its left.
        if BOS:
            begins = marker | (column == 0)
            document = markers_before + _running_sum(begins.to(tl.int64))
            left_document = document - begins.to(tl.int64)
        else:
            document = markers_before + _running_sum(marker.to(tl.int64)) - marker.to(tl.int64) + 1
            left_document = document - left_marker.to(tl.int64)
            begins = marker
        document = tl.where(valid, document, 0)
        left_document = tl.where(left_valid, left_document, 0)
        if RESET_POSITIONS:
            position, _, _, first_seen, last_valid = _positions(
                document, left_document, column, last_id, seen, first_seen, last_valid
            )
            last_id = tl.maximum(last_id, tl.max(document, 0))
            seen += tl.sum(valid.to(tl.int64), 0)
        else:
            position = column.to(tl.int64)
        if not RESET_DOCUMENTS:  # one document a row (Megatron's plain causal mask)
            document = valid.to(tl.int64)
        keep = valid
        if EOD_MASK_LOSS:
            keep = keep & ~marker
        tl.store(documents + row * sequence + column, document, mask=inside)
        tl.store(positions + row * sequence + column, position, mask=inside)
        tl.store(loss_mask + row * sequence + column, keep, mask=inside)
        if VOCAB == 1:
            outside = tl.maximum(outside, tl.max((inside & (token < 0)).to(tl.int64), 0))
        if VOCAB == 2:
            outside = tl.maximum(outside, tl.max((inside & ((token < 0) | (token >= vocab_size))).to(tl.int64), 0))
        markers_before += tl.sum(begins.to(tl.int64), 0)
    tl.store(stats + row, outside)


@triton.jit
def _at_or_before(bounds, width, count, last, limit, column, TABLE: tl.constexpr):
    """How many of a row's ``width`` sorted boundaries lie at or before each column: a binary search per column.

    ``TABLE``: ``bounds`` is a cu_seqlens table, read as the aten body reads
    it (its first ``count`` entries, then ``last``, clamped to ``[0, limit]``);
    else running sums a kernel wrote. The result only goes into stored values,
    never into a store's address (NOTE [Two launches on a GPU]).
    """
    step = tl.full((), 1, tl.int64)
    while step * 2 <= width:
        step *= 2
    found = tl.zeros(column.shape, tl.int64)
    while step > 0:
        # Uniform binary search: take ``step`` more boundaries wherever the last of them is at or before the column.
        taken = found + step
        inside = taken <= width
        value = tl.load(bounds + taken - 1, mask=inside, other=0).to(tl.int64)
        if TABLE:
            value = tl.minimum(tl.maximum(tl.where(taken - 1 < count, value, last), 0), limit)
        found = tl.where(inside & (value <= column), taken, found)
        step = step // 2
    return found


@triton.jit
def _length_rows(lengths, ends, ids, stats, width, sequence, BLOCK: tl.constexpr):
    """``document_ids_from_seq_lens``: a row's ends (running sums of its lengths, each clamped to ``[0, sequence +
    1]`` as the aten body clamps them), then each column's 1-based document, 0 past the row's last end."""
    row = tl.program_id(0).to(tl.int64)
    lengths += row * width
    ends += row * width
    ids += row * sequence
    zero = tl.full((), 0, tl.int64)
    total, negative = zero, zero
    for begin in range(0, width, BLOCK):
        slot = begin + tl.arange(0, BLOCK)
        length = tl.load(lengths + slot, mask=slot < width, other=0).to(tl.int64)
        negative = tl.maximum(negative, tl.max((length < 0).to(tl.int64), 0))
        end = total + _running_sum(_clamped(length, sequence))
        tl.store(ends + slot, end, mask=slot < width)
        total = tl.max(end, 0)  # the slots past the row add 0
    tl.debug_barrier()  # the row's ends, stored by all of this program's threads, before any thread reads them
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        found = _at_or_before(ends, width, zero, zero, zero, column, TABLE=False)
        tl.store(ids + column, tl.where(column < total, found + 1, 0), mask=column < sequence)
    tl.store(stats + row * 2, negative)
    tl.store(stats + row * 2 + 1, (total > sequence).to(tl.int64))


@triton.jit
def _boundary_rows(
    table, mask, ids, stats, width, sequence, limit, FLAT: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr
):
    """``document_ids_from_cu_seqlens``: a row's table (``FLAT``: the one table over all rows) checked and read as
    the aten body reads it, then each column's segment by a binary search; the rules' flags per row."""
    row = tl.program_id(0).to(tl.int64)
    if not FLAT:
        table += row * width
    ids += row * sequence
    zero = tl.full((), 0, tl.int64)
    count, absent, decrease, misplaced, over = zero, zero, zero, zero, zero
    for begin in range(0, width, BLOCK):
        slot = begin + tl.arange(0, BLOCK)
        inside = slot < width
        value = tl.load(table + slot, mask=inside, other=0).to(tl.int64)
        left = tl.load(table + slot - 1, mask=inside & (slot > 0), other=0).to(tl.int64)
        present = inside & (value >= 0)
        pair = present & (slot > 0) & (left >= 0)
        # Any absent (-1) entry at or before each slot: a present one after it is misplaced.
        absent_so_far = tl.maximum(tl.associative_scan((inside & ~present).to(tl.int64), 0, _maximum), absent)
        count += tl.sum(present.to(tl.int64), 0)
        decrease = tl.maximum(decrease, tl.max((pair & (value < left)).to(tl.int64), 0))
        wrong = inside & ((value < -1) | (present & (absent_so_far > 0)))
        misplaced = tl.maximum(misplaced, tl.max(wrong.to(tl.int64), 0))
        over = tl.maximum(over, tl.max((inside & (value > limit)).to(tl.int64), 0))
        absent = tl.max(absent_so_far, 0)
    first = tl.load(table).to(tl.int64)
    last = tl.load(table + tl.maximum(count - 1, 0)).to(tl.int64)
    final = tl.load(table + width - 1).to(tl.int64)
    final = tl.minimum(tl.maximum(tl.where(width - 1 < count, final, last), 0), limit)
    opening, crossing = zero + 1, zero  # one table a row: its first boundary, 0, opens the first document
    if FLAT:
        # Ids count the segments from the row's first; a row that begins inside its previous row's last segment
        # cuts a document in two.
        start = row * sequence + tl.zeros((BLOCK,), tl.int64)
        opening = tl.max(_at_or_before(table, width, count, last, limit, start, TABLE=True), 0)
        before = tl.max(_at_or_before(table, width, count, last, limit, start - 1, TABLE=True), 0)
        crossing = ((row > 0) & (row * sequence < final) & (opening == before)).to(tl.int64)
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        token = column
        if FLAT:
            token += row * sequence
        found = _at_or_before(table, width, count, last, limit, token, TABLE=True)
        document = tl.where(token < final, found - opening + 1, 0)
        if MASKED:
            real = tl.load(mask + row * sequence + column, mask=column < sequence, other=0)
            document = tl.where(real != 0, document, 0)
        tl.store(ids + column, document, mask=column < sequence)
    stats += row * 5
    tl.store(stats + 0, (first != 0).to(tl.int64))
    tl.store(stats + 1, decrease)
    tl.store(stats + 2, misplaced)
    tl.store(stats + 3, over)
    tl.store(stats + 4, crossing)


@triton.jit
def _position_id_rows(
    positions,
    mask,
    ids,
    stats,
    sequence,
    pad,
    start,
    MASKED: tl.constexpr,
    PAD: tl.constexpr,
    START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``document_ids_from_position_ids``: a document starts where a valid token's position is not one past the
    previous valid token's (the row's first valid token starts one); 0 at padding."""
    row = tl.program_id(0).to(tl.int64)
    positions += row * sequence
    ids += row * sequence
    zero = tl.full((), 0, tl.int64)
    previous_valid, count, negative, restart = zero - 1, zero, zero, zero
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        value = tl.load(positions + column, mask=inside, other=0).to(tl.int64)
        left = tl.load(positions + column - 1, mask=inside & (column > 0), other=0).to(tl.int64)
        valid = inside
        left_valid = inside & (column > 0)
        if MASKED:
            mask_row = mask + row * sequence
            valid = valid & (tl.load(mask_row + column, mask=inside, other=0) != 0)
            left_valid = left_valid & (tl.load(mask_row + column - 1, mask=inside & (column > 0), other=0) != 0)
        if PAD:
            valid = valid & (value != pad)
            left_valid = left_valid & (left != pad)
        if MASKED or PAD:
            # The previous valid token's column, -1 where none: its position is read back from the row.
            earlier = tl.maximum(tl.associative_scan(tl.where(left_valid, column - 1, -1), 0, _maximum), previous_valid)
            before = tl.load(positions + earlier, mask=inside & (earlier >= 0), other=0).to(tl.int64)
            starts = valid & ((earlier < 0) | (value != before + 1))
        else:
            starts = inside & (value != tl.where(column > 0, left, -2) + 1)
        document = count + _running_sum(starts.to(tl.int64))
        tl.store(ids + column, tl.where(valid, document, 0), mask=inside)
        negative = tl.maximum(negative, tl.max((valid & (value < 0)).to(tl.int64), 0))
        if START:
            restart = tl.maximum(restart, tl.max((starts & (value != start)).to(tl.int64), 0))
        count += tl.sum(starts.to(tl.int64), 0)
        previous_valid = tl.maximum(previous_valid, tl.max(tl.where(valid, column, -1), 0))
    tl.store(stats + row * 2, negative)
    tl.store(stats + row * 2 + 1, restart)


def _row_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """The mask as the kernels read it: contiguous (a bool mask as it is: Triton loads it as ``int1``; torch 2.11's
    Inductor cannot lower the ``view(torch.uint8)`` of a bool graph input for CUDA, "torch.bool is not supported by
    torch.iinfo")."""
    return document_ids.contiguous()


def _flags(stats: torch.Tensor, max_documents: int) -> torch.Tensor:
    """The mask rules' flags (``mask_rules``) from the rows' stats.

    Three reductions by aten, not flags written by a kernel: Inductor fuses
    them with the public function's asserts into one kernel. The op alone,
    asserts left out, launches the three reductions apart.
    """
    return _any(stats[:, 3] != 0, stats[:, 4] != 0, stats[:, 1] > max_documents)


def _any(*rows: torch.Tensor) -> torch.Tensor:
    """Whether each bool ``[batch]`` is true in any row: one small reduction each, which Inductor fuses."""
    return torch.stack([row.any() for row in rows])


def _stats(ids: torch.Tensor) -> torch.Tensor:
    batch, sequence = ids.shape
    stats = ids.new_empty(batch, STATS, dtype=torch.int64)
    wrap_triton(_row_stats)[(batch,)](ids, stats, sequence, BLOCK=BLOCK)
    return stats


def mask_flags_kernels(document_ids: torch.Tensor) -> torch.Tensor:
    """``mask_flags`` of a mask (``D = sequence``): one pass of ``_row_stats``, where the aten body parses the mask."""
    ids = _row_ids(document_ids)
    return _flags(_stats(ids), ids.shape[1])


def varlen_kernels(document_ids: torch.Tensor, max_documents: int):
    """``packfn::varlen_metadata`` in two launches (NOTE [Two launches on a GPU])."""
    ids = _row_ids(document_ids)
    batch, sequence = ids.shape
    capacity = batch * max_documents
    new = ids.new_empty
    indices = new(batch * sequence, dtype=torch.int64)
    cu_seqlens = new(capacity + 1, dtype=torch.int32)
    seqlens = new(capacity, dtype=torch.int32)
    # One-element buffers viewed as 0-d: Inductor writes an empty 0-d tensor with a kernel of its own.
    max_seqlen = new(1, dtype=torch.int32)
    num_tokens = new(1, dtype=torch.int64)
    num_documents = new(1, dtype=torch.int64)
    stats = _stats(ids)
    wrap_triton(_varlen_rows)[(batch,)](
        ids,
        stats,
        indices,
        cu_seqlens,
        seqlens,
        max_seqlen,
        num_tokens,
        num_documents,
        batch,
        sequence,
        max_documents,
        BLOCK=BLOCK,
        ROWS=ROWS,
    )
    scalars = (tensor.view(()) for tensor in (max_seqlen, num_tokens, num_documents))
    return indices, cu_seqlens, seqlens, *scalars, _flags(stats, max_documents)


def batch_kernels(document_ids: torch.Tensor, max_documents: int):
    """``packfn::batch_metadata`` in two launches (NOTE [Two launches on a GPU])."""
    ids = _row_ids(document_ids)
    batch, sequence = ids.shape
    new = ids.new_empty
    packed_token_indices = new(batch, sequence, dtype=torch.int64)
    cu_seqlens = new(batch, max_documents + 1, dtype=torch.int32)
    row_max_seqlen = new(batch, dtype=torch.int32)
    num_documents = new(batch, dtype=torch.int64)
    stats = _stats(ids)
    wrap_triton(_batch_rows)[(batch,)](
        ids,
        stats,
        packed_token_indices,
        cu_seqlens,
        row_max_seqlen,
        num_documents,
        batch,
        sequence,
        max_documents,
        BLOCK=BLOCK,
        ROWS=ROWS,
    )
    return packed_token_indices, cu_seqlens, row_max_seqlen, num_documents, _flags(stats, max_documents)


def physical_varlen_kernels(document_ids: torch.Tensor):
    """``packfn::physical_varlen_metadata`` in two launches (NOTE [Two launches on a GPU])."""
    ids = _row_ids(document_ids)
    batch, sequence = ids.shape
    new = ids.new_empty
    cu_seqlens = new(batch * sequence + 1, dtype=torch.int32)
    max_seqlen = new(1, dtype=torch.int32)
    num_segments = new(1, dtype=torch.int64)
    stats = new(batch, 2, dtype=torch.int64)
    wrap_triton(_segment_stats)[(batch,)](ids, stats, sequence, BLOCK=BLOCK)
    wrap_triton(_segment_rows)[(batch,)](
        ids, stats, cu_seqlens, max_seqlen, num_segments, batch, sequence, BLOCK=BLOCK, ROWS=ROWS
    )
    return cu_seqlens, max_seqlen.view(()), num_segments.view(())


def thd_kernels(document_ids: torch.Tensor, max_documents: int):
    """``packfn::thd_metadata`` in two launches (NOTE [Two launches on a GPU])."""
    ids = _row_ids(document_ids)
    batch, sequence = ids.shape
    capacity = batch * max_documents
    cu_seqlens = ids.new_empty(capacity + 1, dtype=torch.int32)
    cu_seqlens_padded = ids.new_empty(capacity + 1, dtype=torch.int32)
    stats = _stats(ids)
    wrap_triton(_thd_rows)[(batch,)](
        ids, stats, cu_seqlens, cu_seqlens_padded, batch, sequence, max_documents, BLOCK=BLOCK, ROWS=ROWS
    )
    leading = (ids[0, 0] == 0) & (stats[:, 0] > 0)  # the first row begins with padding, and a document follows
    return cu_seqlens, cu_seqlens_padded, torch.cat([_flags(stats, max_documents), _any(stats[:, 5] != 0, leading)])


def flatten_kernels(packed_token_indices: torch.Tensor, cu_seqlens: torch.Tensor):
    """``packfn::flatten_metadata`` in two launches (NOTE [Two launches on a GPU])."""
    tokens, bounds = packed_token_indices.contiguous(), cu_seqlens.contiguous()
    batch, sequence = tokens.shape
    slots = bounds.shape[1]
    new = tokens.new_empty
    indices = new(batch * sequence, dtype=torch.int64)
    flat = bounds.new_empty(batch * (slots - 1) + 1)
    num_tokens = new(1, dtype=torch.int64)
    num_documents = new(1, dtype=torch.int64)
    stats = new(batch, FLATTEN_STATS, dtype=torch.int64)
    wrap_triton(_flatten_stats)[(batch,)](tokens, bounds, stats, sequence, slots, BLOCK=BLOCK)
    wrap_triton(_flatten_rows)[(batch,)](
        tokens, bounds, stats, indices, flat, num_tokens, num_documents, batch, sequence, slots, BLOCK=BLOCK, ROWS=ROWS
    )
    broken = _any(*(stats[:, column] != 0 for column in range(3, 7)))
    return indices, flat, num_tokens.view(()), num_documents.view(()), broken


def position_kernels(document_ids: torch.Tensor):
    """``packfn::position_ids`` in one launch (NOTE [Two launches on a GPU])."""
    ids = _row_ids(document_ids)
    batch, sequence = ids.shape
    positions = ids.new_empty(batch, sequence, dtype=torch.int64)
    stats = ids.new_empty(batch, 2, dtype=torch.int64)
    wrap_triton(_position_rows)[(batch,)](ids, positions, stats, sequence, BLOCK=BLOCK)
    # The third rule (too many documents) has no cap here: never broken, as in the aten body.
    return positions, torch.stack([stats[:, 0].any(), stats[:, 1].any(), stats.new_zeros((), dtype=torch.bool)])


def block_tables_kernels(
    document_ids: torch.Tensor,
    block_size: int,
    window: int | None,
    separate_full: bool,
    positions: torch.Tensor | None,
    check: bool,
):
    """``packfn::document_block_tables``: the blocks' summaries by aten (one fused reduction), then one launch of
    ``_block_tables`` for all eight tables, where the aten body sorts four ``[B, 1, Q, K]`` tables."""
    summaries = block_summaries(document_ids, block_size, window, positions)
    batch, _, blocks = summaries.shape
    new = summaries.new_empty
    tables = []
    for _ in range(4):
        tables += [new(batch, 1, blocks, dtype=torch.int32), new(batch, 1, blocks, blocks, dtype=torch.int32)]
    wrap_triton(_block_tables)[(batch * blocks,)](
        summaries,
        *tables,
        blocks,
        block_size,
        0 if window is None else window,
        WINDOW=window is not None,
        SEPARATE=separate_full,
        CHUNK=CHUNK,
    )
    return (*tables, mask_flags(document_ids.to(torch.int64), check))


def seq_lens_kernels(seq_lens: torch.Tensor, sequence: int):
    """``packfn::document_ids_from_seq_lens`` in one launch (``_length_rows``)."""
    lengths = seq_lens.contiguous()
    batch, width = lengths.shape
    new = lengths.new_empty
    ids = new(batch, sequence, dtype=torch.int64)
    ends = new(batch, width, dtype=torch.int64)  # the kernel's own: each row's ends, searched by every column
    stats = new(batch, 2, dtype=torch.int64)
    wrap_triton(_length_rows)[(batch,)](lengths, ends, ids, stats, width, sequence, BLOCK=BLOCK)
    return ids, _any(stats[:, 0] != 0, stats[:, 1] != 0)


def cu_seqlens_kernels(cu_seqlens: torch.Tensor, batch: int, sequence: int, attention_mask: torch.Tensor | None):
    """``packfn::document_ids_from_cu_seqlens`` in one launch (``_boundary_rows``), flat or one table per row."""
    table = cu_seqlens.contiguous()
    flat = table.ndim == 1
    ids = table.new_empty(batch, sequence, dtype=torch.int64)
    stats = table.new_empty(batch, 5, dtype=torch.int64)
    mask = table if attention_mask is None else _row_ids(attention_mask)  # read only where MASKED
    wrap_triton(_boundary_rows)[(batch,)](
        table,
        mask,
        ids,
        stats,
        table.shape[-1],
        sequence,
        batch * sequence if flat else sequence,
        FLAT=flat,
        MASKED=attention_mask is not None,
        BLOCK=BLOCK,
    )
    return ids, _any(*(stats[:, column] != 0 for column in range(5)))


def position_id_kernels(
    position_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_position: int | None, start: int | None
):
    """``packfn::document_ids_from_position_ids`` in one launch (``_position_id_rows``)."""
    positions = position_ids.contiguous()
    batch, sequence = positions.shape
    pad = pad_position is not None and format_ops.holds(torch.int64, pad_position)  # compared in int64, as there
    ids = positions.new_empty(batch, sequence, dtype=torch.int64)
    stats = positions.new_empty(batch, 2, dtype=torch.int64)
    mask = positions if attention_mask is None else _row_ids(attention_mask)  # read only where MASKED
    wrap_triton(_position_id_rows)[(batch,)](
        positions,
        mask,
        ids,
        stats,
        sequence,
        pad_position if pad else 0,
        0 if start is None else start,
        MASKED=attention_mask is not None,
        PAD=pad,
        START=start is not None,
        BLOCK=BLOCK,
    )
    return ids, _any(stats[:, 0] != 0, stats[:, 1] != 0)


EOS_MARKERS = 4  # the most marker tokens _eos_rows compares with; more take the aten body


def eos_kernels(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eos_token_ids: list[int],
    bos: bool,
    pad_token_id: int | None,
    vocab_size: int | None,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
):
    """``packfn::document_ids_from_eos`` in one launch (``_eos_rows``), for up to ``EOS_MARKERS`` marker tokens."""
    arguments = (input_ids, attention_mask, eos_token_ids, bos, pad_token_id, vocab_size)
    arguments += (reset_position_ids, reset_attention_mask, eod_mask_loss)
    markers = format_ops.held(input_ids.dtype, eos_token_ids)
    if len(markers) > EOS_MARKERS:
        return format_ops.document_ids_from_eos_op.math(*arguments)
    tokens = input_ids.contiguous()
    batch, sequence = tokens.shape
    pad = pad_token_id is not None and format_ops.holds(tokens.dtype, pad_token_id)
    vocabulary = 0 if vocab_size is None else 2 if format_ops.holds(tokens.dtype, vocab_size) else 1
    new = tokens.new_empty
    documents = new(batch, sequence, dtype=torch.int64)
    positions = new(batch, sequence, dtype=torch.int64)
    loss_mask = new(batch, sequence, dtype=torch.bool)
    stats = new(batch, dtype=torch.int64)
    wrap_triton(_eos_rows)[(batch,)](
        tokens,
        tokens if attention_mask is None else _row_ids(attention_mask),  # read only where MASKED
        documents,
        positions,
        loss_mask,
        stats,
        sequence,
        pad_token_id if pad else 0,
        vocab_size if vocabulary == 2 else 0,
        *(markers + [0] * EOS_MARKERS)[:EOS_MARKERS],
        MARKERS=len(markers),
        BOS=bos,
        MASKED=attention_mask is not None,
        PAD=pad,
        VOCAB=vocabulary,
        RESET_POSITIONS=reset_position_ids,
        RESET_DOCUMENTS=reset_attention_mask,
        EOD_MASK_LOSS=eod_mask_loss,
        BLOCK=BLOCK,
    )
    return documents, positions, loss_mask, _any(stats != 0)


# ------------------------------------------------------------------ pad

PAD_BLOCK = 32  # positions a program of _pad_rows moves
PAD_WIDTH = 128  # elements of a position's row it moves at a time
# What _pad_rows moves as it is (what packfn.pad hands the op: uint16/32/64 come as their signed twins); any other
# dtype (complex, float8) takes the aten body.
PAD_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.float16, torch.bfloat16, torch.float32, torch.float64}
)


@triton.jit
def _pad_rows(values, indices, num_tokens, padded, flags, total, width, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """``pad``: each position's row in the varlen order, found by a binary search over the valid positions (the aten
    body's ``searchsorted``), that row of ``values`` moved to the position (zeros at padding), and whether the
    block's positions break :data:`PAD_RULES` (an entry outside the positions, a part not ascending, a position
    the inverse does not give back)."""
    program = tl.program_id(0).to(tl.int64)
    position = program * BLOCK + tl.arange(0, BLOCK)
    inside = position < total
    count = tl.load(num_tokens).to(tl.int64)
    index = tl.load(indices + position, mask=inside, other=0).to(tl.int64)
    following = tl.load(indices + position + 1, mask=position + 1 < total, other=total).to(tl.int64)
    unordered = (position + 1 < total) & (position + 1 != count) & (following <= index)
    outside = inside & ((index < 0) | (index >= total))
    # The valid positions before each position; where the rules hold the valid part is sorted, as the search needs.
    before = _at_or_before(indices, total, count, total, total, position - 1, TABLE=True)
    slot = tl.minimum(before, total - 1)
    found = tl.load(indices + slot, mask=inside & (slot < count), other=total).to(tl.int64)
    inverse = tl.where(found == position, before, count + position - before)
    back = tl.load(indices + tl.minimum(tl.maximum(inverse, 0), total - 1), mask=inside, other=0).to(tl.int64)
    tl.store(flags + program, tl.max((unordered | outside | (inside & (back != position))).to(tl.int64), 0))
    keep = inside & (inverse < tl.minimum(count, total))
    source = tl.where(keep, inverse, 0)
    for begin in range(0, width, WIDTH):
        column = begin + tl.arange(0, WIDTH)
        within = column[None, :] < width
        row = tl.load(values + source[:, None] * width + column[None, :], mask=keep[:, None] & within, other=0)
        tl.store(padded + position[:, None] * width + column[None, :], row, mask=inside[:, None] & within)


def pad_kernels(values: torch.Tensor, indices: torch.Tensor, num_tokens: torch.Tensor, sequence: int):
    """``packfn::pad`` in one launch (``_pad_rows``), where the aten body launched four (a search, the check's
    gather and reduction, the rows' gather); :data:`PAD_DTYPES` only, any other dtype takes the aten body."""
    if values.dtype not in PAD_DTYPES:
        return varlen_ops.pad_op.math(values, indices, num_tokens, sequence)
    rows = values.contiguous()
    total = indices.numel()
    width = 1
    for size in values.shape[1:]:
        width *= size
    padded = rows.new_empty(values.shape[0] // sequence, sequence, *values.shape[1:])
    programs = (total + PAD_BLOCK - 1) // PAD_BLOCK
    flags = indices.new_empty(programs, dtype=torch.int64)
    wrap_triton(_pad_rows)[(programs,)](
        rows, indices.contiguous(), num_tokens, padded, flags, total, width, BLOCK=PAD_BLOCK, WIDTH=PAD_WIDTH
    )
    broken = (flags != 0).any() | (num_tokens < 0) | (num_tokens > total)
    return padded, broken.reshape(1)


# ------------------------------------------------------------------ aligned layout


@triton.jit
def _layout_rows(
    lengths,
    spans,
    input_ends,
    aligned_ends,
    sources,
    positions,
    sequences,
    inputs,
    stats,
    width,
    sequence,
    alignment,
    length,
    BLOCK: tl.constexpr,
):
    """``aligned_layout``: a row's documents (their ends in the input row by span and in the aligned row by length
    rounded up to ``alignment``, each clamped to ``[0, sequence + 1]`` as the aten body clamps them, and the rules
    the first broken one breaks), then each aligned column's document and each input column's, by a binary search
    over those ends (``_at_or_before``): every document starts on a multiple of ``alignment``, so an aligned
    column's document is its block's."""
    row = tl.program_id(0).to(tl.int64)
    lengths += row * width
    spans += row * width
    input_ends += row * width
    aligned_ends += row * width
    sources += row * length
    positions += row * length
    sequences += row * length
    inputs += row * sequence
    zero = tl.full((), 0, tl.int64)
    input_total, aligned_total, first = zero, zero, zero
    for begin in range(0, width, BLOCK):
        slot = begin + tl.arange(0, BLOCK)
        inside = slot < width
        count = tl.load(lengths + slot, mask=inside, other=0).to(tl.int64)
        span = tl.load(spans + slot, mask=inside, other=0).to(tl.int64)
        present = count != 0
        real = _clamped(count, sequence)
        kept = tl.where(present, _clamped(span, sequence), 0)
        input_end = input_total + _running_sum(kept)
        aligned_end = aligned_total + _running_sum((real + alignment - 1) // alignment * alignment)
        tl.store(input_ends + slot, input_end, mask=inside)
        tl.store(aligned_ends + slot, aligned_end, mask=inside)
        # The layout_rules a document breaks, as bits (1: a span without a document, 2: a negative length, 4: a
        # span shorter than the length, 8: past the input row); the first broken document's, carried.
        bits = (~present & (span != 0)).to(tl.int64)
        bits |= (present & (count < 0)).to(tl.int64) * 2
        bits |= (present & (span < count)).to(tl.int64) * 4
        bits |= (present & (input_end > sequence)).to(tl.int64) * 8
        earliest = tl.min(tl.where(bits != 0, slot, width), 0)
        first = tl.where(first != 0, first, tl.sum(tl.where(slot == earliest, bits, 0), 0))
        input_total = tl.max(input_end, 0)  # the slots past the row add 0
        aligned_total = tl.max(aligned_end, 0)
    tl.debug_barrier()  # the row's ends, stored by all of this program's threads, before any thread reads them
    for begin in range(0, length, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < length
        slot = _at_or_before(aligned_ends, width, zero, zero, zero, column, TABLE=False)
        start = tl.load(aligned_ends + slot - 1, mask=inside & (slot > 0), other=0)
        source = tl.load(input_ends + slot - 1, mask=inside & (slot > 0), other=0)
        real = tl.load(lengths + slot, mask=inside & (slot < width), other=0).to(tl.int64)
        offset = column - start
        outside = offset >= _clamped(real, sequence)
        tl.store(sources + column, tl.where(outside, -1, source + offset), mask=inside)
        tl.store(positions + column, tl.where(outside, 0, offset), mask=inside)
        tl.store(sequences + column, tl.where(outside, 0, slot + 1), mask=inside)
    for begin in range(0, sequence, BLOCK):
        column = begin + tl.arange(0, BLOCK)
        inside = column < sequence
        slot = _at_or_before(input_ends, width, zero, zero, zero, column, TABLE=False)
        start = tl.load(input_ends + slot - 1, mask=inside & (slot > 0), other=0)
        target = tl.load(aligned_ends + slot - 1, mask=inside & (slot > 0), other=0)
        real = _clamped(tl.load(lengths + slot, mask=inside & (slot < width), other=0).to(tl.int64), sequence)
        tl.store(inputs + column, tl.where(column < start + real, column - start + target, -1), mask=inside)
    tl.store(stats + row * 2, first)
    tl.store(stats + row * 2 + 1, aligned_total)


def layout_kernels(
    seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, sequence_length: int, alignment: int, length: int
):
    """``packfn::aligned_layout`` in one launch (``_layout_rows``), then one reduction over the rows: the first
    broken document's rules (the rows' bits, the earliest row's kept by the maximum) and the longest aligned row."""
    lengths, spans = seq_lens.contiguous(), seq_lens_padded.contiguous()
    batch, width = lengths.shape
    new = lengths.new_empty
    sources, positions, sequences = (new(batch, length, dtype=torch.int64) for _ in range(3))
    inputs = new(batch, sequence_length, dtype=torch.int64)
    input_ends, aligned_ends = (new(batch, width, dtype=torch.int64) for _ in range(2))  # the kernel's own
    stats = new(batch, 2, dtype=torch.int64)
    wrap_triton(_layout_rows)[(batch,)](
        lengths, spans, input_ends, aligned_ends, sources, positions, sequences, inputs, stats,
        width, sequence_length, alignment, length, BLOCK=BLOCK,
    )  # fmt: skip
    first, totals = stats[:, 0], stats[:, 1]
    rows = torch.arange(batch, device=lengths.device)
    earliest = torch.where(first != 0, (batch - rows) * 16 + first, 0).max() % 16
    longest = totals.max()
    rules = (earliest.bitwise_right_shift(torch.arange(4, device=lengths.device)) & 1) != 0
    return sources, positions, sequences, inputs, longest, torch.cat([rules, (longest > length).reshape(1)])
