"""Load-balanced context parallelism: per-document head-tail shards, with static shapes and no host read.

Under causal attention a query's work grows with its position inside its
document, so the contiguous shards of :mod:`packfn.distributed.cp` leave the
last ranks of a row with most of the work. Here every document (each one
rounded up to ``2 * world * alignment`` columns, its *width*) is cut into
``2 * world`` equal chunks and rank ``r`` keeps a head chunk and the
matching tail chunk of **every** document, so each rank holds an equal
share of every document's work. The row's padding after its last document
is one more such "document" (it has no work). Example, ``world=2``,
``alignment=1``, ``budget=16``, documents of 8 and 4 tokens, chunks of 2
and 1 columns::

    row column        0  1  2  3  4  5  6  7 | 8  9 10 11 | 12 13 14 15
    sequence_ids      1  1  1  1  1  1  1  1 | 2  2  2  2 |  0  0  0  0
    chunk             0  0  1  1  2  2  3  3 | 0  1  2  3 |  0  1  2  3

    balance="head_tail": rank r keeps chunks r and 3 - r of every document
    rank 0 (columns)  0  1  6  7  8 11 12 15
    rank 1 (columns)  2  3  4  5  9 10 13 14

    balance="rotated" (the default): document k's chunk pair is rotated by k
    rank 0 (columns)  0  1  6  7  9 10 12 15
    rank 1 (columns)  2  3  4  5  8 11 13 14

Every rank's shard has ``budget // world`` columns, and the shards of ranks
0, 1, ... one after the other (what :func:`packfn.distributed.all_gather_sequence`
returns) are the *gathered order* of the row. The shard's ``layout`` is the
layout of the whole batch in that order, so ``layout.restore`` of gathered
outputs gives the input columns with the pack / restore gathers (NOTE [Why
pack and restore are each other's backward]).

NOTE [Rotating short documents]
Head-tail balances a document exactly when its width is all real tokens:
the work of chunk ``j`` grows linearly in ``j``, so chunks ``j`` and
``2W - 1 - j`` always sum to the same. A document shorter than its width
ends in padding, which falls in the tail chunks; a document of fewer tokens
than ``2 * world`` chunks carries work only in its first chunks. Pure
head-tail then gives that work to the same low ranks for every document.
``balance="rotated"`` has rank ``r`` keep pair ``(r + k) % world`` of the
``k``-th present document of the batch (batch-major), so the heavy pairs of
consecutive short documents land on different ranks. On best-fit batches
of exponential lengths of mean 150 and 300 in rows of 8192 at world 8 the
worst batch goes from 1.08 to 1.02 times the mean work (docs/distributed.md
has the table); long documents are balanced either way. ``"head_tail"`` is
the order of torch's ``_PerDocumentHeadTailLoadBalancer`` and of Megatron's
Transformer Engine partition (chunks ``r`` and ``2W - 1 - r`` of each
document).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from packfn._ops.layout import pack_op
from packfn._ops.metadata import search_running_sums
from packfn._utils import round_up
from packfn.layout import PackedSequenceLayout, aligned_layout, as_rows

__all__ = [
    "BALANCES",
    "BalancePlan",
    "BalancedKeys",
    "balanced_kv_blocks",
    "balanced_layout",
    "balanced_varlen",
]

BALANCES = ("rotated", "head_tail", "contiguous")
"""The ``balance`` values of :func:`packfn.shard_packed_batch`, the default first."""


class BalancePlan(NamedTuple):
    """Where every document's chunks go, for the attention inputs of a balanced shard (all int64).

    Slot ``D`` (the last) is the row's padding after its documents.

    Attributes:
        widths: ``[batch, D + 1]``: each slot's width in the row (its length
            rounded up to ``2 * world * alignment``; 0 for an absent slot),
            then the rest of ``budget``.
        rotation: ``[batch, D + 1]``: rank ``r`` keeps chunk pair
            ``(r + rotation) % world`` of the slot (0 for ``"head_tail"``).
        key_columns: ``[batch, budget]``: the row column of each gathered
            column (the rearrange indices of torch's load balancers).
        slots: ``[batch, local]``: the slot of each shard column, the same on
            every rank.
    """

    widths: torch.Tensor
    rotation: torch.Tensor
    key_columns: torch.Tensor
    slots: torch.Tensor


class _Slots(NamedTuple):
    """Per-slot tables derived from a plan's widths (``[batch, D + 1]``, int64)."""

    chunk: torch.Tensor  # columns per chunk, width // (2 * world)
    start: torch.Tensor  # first row column
    local_start: torch.Tensor  # first shard column (start // world)


def _slot_tables(widths: torch.Tensor, world: int) -> _Slots:
    start = F.pad(widths, (1, 0)).cumsum(1)[:, :-1]
    return _Slots(widths // (2 * world), start, start // world)


def _slot_of(widths: torch.Tensor, count: int) -> torch.Tensor:
    """int64 ``[batch, count]``: the slot holding each of ``count`` columns (the widths sum to ``count``)."""
    batch, slots = widths.shape
    found = search_running_sums(widths, torch.arange(count, device=widths.device), right=True)
    return found - torch.arange(batch, device=widths.device).unsqueeze(1) * slots


def _take(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[b, index[b, ...]]`` for a ``[batch, n]`` table and an index of any trailing shape."""
    return table.gather(1, index.flatten(1)).view(index.shape)


def _row_columns(tables: _Slots, rotation: torch.Tensor, slots: torch.Tensor, world: int) -> torch.Tensor:
    """int64 ``[batch, world, local]``: the row column of each shard column, for every rank."""
    local = slots.shape[1]
    chunk = _take(tables.chunk, slots).unsqueeze(1)
    offset = (torch.arange(local, device=slots.device) - _take(tables.local_start, slots)).unsqueeze(1)
    ranks = torch.arange(world, device=slots.device).view(1, world, 1)
    pair = (ranks + _take(rotation, slots).unsqueeze(1)) % world
    # The first `chunk` columns of a slot's block are the head chunk `pair`,
    # the next `chunk` its tail chunk `2 * world - 1 - pair`.
    head = offset < chunk
    within = torch.where(head, pair * chunk + offset, (2 * world - 2 - pair) * chunk + offset)
    return _take(tables.start, slots).unsqueeze(1) + within


def _gathered_columns(
    tables: _Slots, rotation: torch.Tensor, widths: torch.Tensor, world: int, local: int
) -> torch.Tensor:
    """int64 ``[batch, budget]``: the gathered column of each row column (the inverse of ``key_columns``)."""
    budget = world * local
    slots = _slot_of(widths, budget)
    chunk = _take(tables.chunk, slots).clamp_min(1)  # a slot of width 0 holds no column
    offset = torch.arange(budget, device=widths.device) - _take(tables.start, slots)
    index, within = offset // chunk, offset % chunk
    pair = torch.minimum(index, 2 * world - 1 - index)
    rank = (pair - _take(rotation, slots)) % world
    shard_column = _take(tables.local_start, slots) + within + torch.where(index < world, 0, chunk)
    return rank * local + shard_column


def balanced_layout(
    seq_lens: torch.Tensor,
    seq_lens_padded: torch.Tensor | None,
    *,
    sequence_length: int,
    alignment: int,
    budget: int,
    world: int,
    rotate: bool,
) -> tuple[PackedSequenceLayout, BalancePlan]:
    """The layout of the whole batch in gathered order, and its plan (arguments checked by the caller).

    ``budget`` is a multiple of ``2 * world * alignment``. A row whose
    documents, each rounded up to that, exceed ``budget`` trips a sync-free
    assert that names the packer's ``pad_to_multiple_of``.
    """
    unit = 2 * world * alignment
    lengths = as_rows(seq_lens).to(torch.int64)
    batch, documents = lengths.shape
    # Clamped as aligned_layout's tables are, so that broken lengths report
    # their own rule there and no sum wraps.
    widths = round_up(lengths.clamp(0, sequence_length + 1), unit)
    used = widths.sum(1, keepdim=True)
    torch._assert_async(
        (used <= budget).all(),
        f"shard_packed_batch: the documents of a row, each rounded up to 2 * world * alignment = {unit} columns, "
        f"do not fit budget={budget}: pack them with pad_to_multiple_of={unit} (packfn.pack_documents, "
        "pack_stream, packfn.data.PackedDataset)",
    )
    row = aligned_layout(seq_lens, seq_lens_padded, sequence_length=sequence_length, alignment=unit, budget=budget)
    widths = torch.cat([widths, (budget - used).clamp_min(0)], 1)
    if rotate:
        present = (lengths > 0).to(torch.int64).flatten()
        before = (present.cumsum(0) - present).view(batch, documents)
        rotation = F.pad(before % world, (0, 1))
    else:
        rotation = torch.zeros_like(widths)
    local = budget // world
    tables = _slot_tables(widths, world)
    slots = _slot_of(widths // world, local)
    key_columns = _row_columns(tables, rotation, slots, world).flatten(1)
    gathered = _gathered_columns(tables, rotation, widths, world, local)
    positions = row.input_positions
    layout = PackedSequenceLayout(
        source_indices=row.source_indices.gather(1, key_columns),
        input_positions=torch.where(positions >= 0, gathered.gather(1, positions.clamp_min(0)), -1),
        position_ids=row.position_ids.gather(1, key_columns),
        sequence_ids=row.sequence_ids.gather(1, key_columns),
    )
    return layout, BalancePlan(widths, rotation, key_columns, slots)


# ------------------------------------------------------------------ FlexAttention


def balanced_kv_blocks(
    plan: BalancePlan, real: torch.Tensor, rank: int, world: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``BlockMask``'s tensors for one rank's queries against the gathered keys.

    NOTE [Blocks of a balanced shard]
    Every rank's shard has the same slots at the same shard columns (a
    slot's block starts at ``start // world`` on every rank), so a query
    block ``i`` and a key block ``j`` of any rank can share a document only
    through the document that runs from one to the other: for ``i != j``
    that is the last document of the earlier block, which must be the first
    of the later one. Inside a slot, a rank's row columns grow with its
    shard columns (the head chunk precedes the tail chunk), and its real
    tokens come first; so the keys of a document that a key block holds
    start at its first shard column there, and a query attends a key block
    when that column is not after the query's. Diagonal blocks (``i == j``,
    any two ranks) compare each query with the first column of its document
    in the block on the key rank. A block pair is full when every query is
    real, both blocks lie in one document and the last key precedes the
    first query. ``O(batch * blocks**2 + batch * budget)``, as
    :func:`packfn.document_block_mask`.

    Args:
        plan: The shard's :class:`BalancePlan`.
        real: bool ``[batch, local]``: the real queries of this rank.
        rank, world: This rank and the group size.
        block_size: Divides ``local``.

    Returns:
        ``kv_num_blocks`` int32 ``[batch, 1, Q]``, ``kv_indices`` int32
        ``[batch, 1, Q, K]`` (present blocks ascending, then the others),
        and the same two for full blocks; ``Q = local // block_size``,
        ``K = world * Q``, key block ``k`` is block ``k % Q`` of rank ``k // Q``.
    """
    slots = plan.slots
    batch, local = slots.shape
    blocks = local // block_size
    documents = plan.widths.shape[1] - 1  # slot `documents` is the row's padding
    device = slots.device
    columns = plan.key_columns.view(batch, world, local)
    mine = columns[:, rank]
    local_start = _take(_slot_tables(plan.widths, world).local_start, slots)
    block_start = torch.arange(local, device=device) // block_size * block_size
    # The first shard column of each column's document inside its block.
    first_in_block = torch.maximum(local_start, block_start)
    # Diagonal blocks, per key rank: [batch, world, blocks].
    earliest = columns.gather(2, first_in_block.unsqueeze(1).expand(batch, world, local))
    diagonal = (real.unsqueeze(1) & (earliest <= mine.unsqueeze(1))).view(batch, world, blocks, block_size).any(-1)
    first_slot, last_slot = slots[:, ::block_size], slots[:, block_size - 1 :: block_size]

    def latest_real(slot: torch.Tensor) -> torch.Tensor:
        """``[batch, blocks]``: the latest row column of a real query of ``slot`` in each block, -1 if none."""
        own = real & (slots == slot.repeat_interleave(block_size, dim=1))
        return torch.where(own, mine, -1).view(batch, blocks, block_size).amax(-1)

    # Key blocks' first columns of their first and last documents: [batch, world, blocks].
    key_first = columns[:, :, ::block_size]
    key_last = columns.gather(2, first_in_block[:, block_size - 1 :: block_size].unsqueeze(1).expand(-1, world, -1))
    q_first, q_last = latest_real(first_slot), latest_real(last_slot)
    shape = (batch, blocks, world, blocks)  # [batch, query block, key rank, key block]

    def pair(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return query.view(batch, blocks, 1, 1), key.view(batch, 1, 1, blocks)

    query_block = torch.arange(blocks, device=device).view(1, blocks, 1, 1)
    key_block = torch.arange(blocks, device=device).view(1, 1, 1, blocks)
    # Earlier key block: it ends in the query block's first document.
    q_slot, k_slot = pair(first_slot, last_slot)
    before = (q_slot == k_slot) & (q_slot < documents) & (key_last.unsqueeze(1) <= q_first.view(batch, blocks, 1, 1))
    # Later key block: it begins in the query block's last document.
    q_slot, k_slot = pair(last_slot, first_slot)
    after = (q_slot == k_slot) & (q_slot < documents) & (key_first.unsqueeze(1) <= q_last.view(batch, blocks, 1, 1))
    on_diagonal = diagonal.transpose(1, 2).unsqueeze(-1)  # [batch, query block, key rank, 1]
    present = torch.where(
        key_block < query_block, before, torch.where(key_block > query_block, after, on_diagonal)
    ).expand(shape)
    # Full pairs.
    single = (first_slot == last_slot) & (first_slot < documents)
    all_real = real.view(batch, blocks, block_size).all(-1)
    earliest_query = mine.view(batch, blocks, block_size).amin(-1)
    latest_key = columns.view(batch, world, blocks, block_size).amax(-1)
    q_slot, k_slot = pair(first_slot, first_slot)
    full = (
        (all_real & single).view(batch, blocks, 1, 1)
        & single.view(batch, 1, 1, blocks)
        & (q_slot == k_slot)
        & (latest_key.unsqueeze(1) <= earliest_query.view(batch, blocks, 1, 1))
    )
    partial = (present & ~full).flatten(2).unsqueeze(1)
    return (*_ordered(partial), *_ordered(full.flatten(2).unsqueeze(1)))


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block counts and block indices, present blocks ascending first, as ``create_block_mask`` orders them."""
    dense = dense.to(torch.int32)
    return dense.sum(dim=-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(
        torch.int32
    )


# ------------------------------------------------------------------ varlen


class BalancedKeys(NamedTuple):
    """How the varlen key buffer ``[batch, key_length]`` reads the gathered keys ``[batch, budget]`` (int64).

    Each buffer column copies one gathered column, in the first or the
    second table (NOTE [Varlen keys of a balanced shard]); -1 elsewhere.
    The positions tables are their inverses (the buffer column of each
    gathered column's copy, -1 where it has none), so the backward is two
    gathers.
    """

    first_source: torch.Tensor  # [batch, key_length]
    first_positions: torch.Tensor  # [batch, budget]
    second_source: torch.Tensor  # [batch, key_length]
    second_positions: torch.Tensor  # [batch, budget]

    def keys(self, gathered: torch.Tensor) -> torch.Tensor:
        """The key buffer ``[batch, key_length, ...]`` from gathered keys ``[batch, budget, ...]``."""
        first = pack_op(gathered, self.first_source, self.first_positions, 0.0)
        second = pack_op(gathered, self.second_source, self.second_positions, 0.0)
        mask = (self.first_source >= 0).reshape(*self.first_source.shape, *([1] * (gathered.ndim - 2)))
        return torch.where(mask, first, second)


def balanced_varlen(
    plan: BalancePlan, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, BalancedKeys]:
    """Varlen boundaries of one rank's balanced shard: ``cu_seqlens_q``, ``cu_seqlens_k``, their maxima, the keys.

    NOTE [Varlen keys of a balanced shard]
    A rank holds two chunks of each document, and each must see the keys of
    its document up to its own end. Their key ranges overlap (both start at
    the document's first column), which one ``cu_seqlens_k`` over the row
    cannot express. So the keys go into a buffer that holds, per slot, the
    slot's keys up to the end of the head chunk and then the slot's keys up
    to the end of the tail chunk: ``(p + 1) * c`` and ``(2W - p) * c``
    columns for pair ``p`` and chunks of ``c``, ``(2W + 1) * c`` in all, so
    ``key_length = budget + budget // (2 * world)`` per row, static. Slot
    ``k`` contributes two segments (head chunk, tail chunk), each of ``c``
    queries against its key range, so with bottom-right causal alignment
    every query sees exactly the earlier keys of its document. A gathered
    key is copied at most once into each half (first: up to the head
    chunk's end, second: up to the tail chunk's end), so the buffer is two
    packs and its backward two restores: gathers, no atomics.

    Returns:
        ``cu_seqlens_q`` and ``cu_seqlens_k`` int32 ``[batch * 2 * (D + 1) + 1]``,
        ``max_seqlen_q`` and ``max_seqlen_k`` int32 0-d, and the
        :class:`BalancedKeys` that build the buffer.
    """
    widths, rotation = plan.widths, plan.rotation
    budget = plan.key_columns.shape[1]
    local = budget // world
    tables = _slot_tables(widths, world)
    chunk = tables.chunk
    pair = (rank + rotation) % world
    head_keys, tail_keys = (pair + 1) * chunk, (2 * world - pair) * chunk
    queries = torch.stack([chunk, chunk], -1).flatten(1)
    keys = torch.stack([head_keys, tail_keys], -1).flatten(1)
    cu_seqlens_q = F.pad(queries.flatten().cumsum(0), (1, 0)).to(torch.int32)
    cu_seqlens_k = F.pad(keys.flatten().cumsum(0), (1, 0)).to(torch.int32)
    # The buffer: slot k's two key ranges from its buffer start on.
    spans = (2 * world + 1) * chunk
    buffer_start = F.pad(spans, (1, 0)).cumsum(1)[:, :-1]
    key_length = budget + budget // (2 * world)
    slots = _slot_of(spans, key_length)
    offset = torch.arange(key_length, device=widths.device) - _take(buffer_start, slots)
    head = _take(head_keys, slots)
    in_head = offset < head
    row_column = _take(tables.start, slots) + torch.where(in_head, offset, offset - head)
    source = _gathered_columns(tables, rotation, widths, world, local).gather(1, row_column)
    first_source = torch.where(in_head, source, -1)
    second_source = torch.where(in_head, -1, source)
    # The inverse tables, from each gathered column's row column.
    column_slots = plan.slots.repeat(1, world)
    within = plan.key_columns - _take(tables.start, column_slots)
    start, head, tail = (_take(table, column_slots) for table in (buffer_start, head_keys, tail_keys))
    first_positions = torch.where(within < head, start + within, -1)
    second_positions = torch.where(within < tail, start + head + within, -1)
    tables_out = BalancedKeys(first_source, first_positions, second_source, second_positions)
    return cu_seqlens_q, cu_seqlens_k, queries.max().to(torch.int32), keys.max().to(torch.int32), tables_out
