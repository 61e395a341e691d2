"""Load-balanced context parallelism: per-document head-tail shards, with static shapes and no host read.

Under causal attention a query's work grows with its position inside its
document, so the contiguous shards of :mod:`packfn.distributed.cp` leave the
last ranks of a row with most of the work. Here every document takes a
*width* of its length rounded up to ``2 * world * alignment`` columns, cut
into ``2 * world`` equal chunks, and rank ``r`` keeps a head chunk and the
matching tail chunk of **every** document, so each rank holds an equal share
of every document's work. The row's padding after its last document is one
more such slot (it has no work). Example, ``world=2``, ``alignment=1``,
``budget=16``, documents of 7 and 3 tokens (widths 8 and 4, chunks of 2 and
1 columns; ``.`` is padding)::

    width column       0  1  2  3  4  5  6  7 | 8  9 10 11 | 12 13 14 15
    chunk              0  0  1  1  2  2  3  3 | 0  1  2  3 |  0  1  2  3
    position (head_tail)  0  1  2  3  4  5  6  . | 0  1  2  . |  .  .  .  .
    position (rotated)    .  0  1  2  3  4  5  6 | .  0  1  2 |  .  .  .  .

    balance="head_tail": rank r keeps chunks r and 3 - r of every slot
    rank 0: columns 0 1 6 7 8 11 12 15, positions 0 1 6 . 0 . . .   (11 attended pairs)
    rank 1: columns 2 3 4 5 9 10 13 14, positions 2 3 4 5 1 2 . .   (23)

    balance="rotated" (the default): padding first, and rank r keeps pair (r + k) % 2 of document k
    rank 0: columns 0 1 6 7 9 10 12 15, positions . 0 5 6 0 1 . .   (17)
    rank 1: columns 2 3 4 5 8 11 13 14, positions 1 2 3 4 . 2 . .   (17)

Every rank's shard has ``budget // world`` columns, and the shards of ranks
0, 1, ... one after the other (what :func:`packfn.distributed.all_gather_sequence`
returns) are the *gathered order* of the row. The shard's ``layout`` is the
layout of the whole batch in that order, so ``layout.restore`` of gathered
outputs gives the input columns with the pack / restore gathers (NOTE [Why
pack and restore are each other's backward]).

NOTE [Padding first, pairs rotated]
Head-tail balances a document exactly when its width is all real tokens:
chunk ``j`` holds positions ``j * c`` to ``(j + 1) * c - 1``, so chunks
``j`` and ``2W - 1 - j`` always sum to the same work. The width's padding
breaks that where it falls. After the tokens (``"head_tail"``, as torch and
Megatron lay sequences out) it empties the last chunk, the heaviest, which
always belongs to pair 0: the same rank loses work in every document. Before
the tokens (``"rotated"``) it empties the first chunk, the lightest, and
shifts every position down by the padding, which costs every pair the same
(up to ``padding**2 / 2`` pairs). A document of fewer tokens than chunks
still carries its work in a few chunks only, so ``"rotated"`` also turns the
pairs: rank ``r`` keeps pair ``(r + k) % world`` of the ``k``-th present
document of the batch (batch-major), and the heavy pairs of consecutive
short documents land on different ranks. On best-fit batches of exponential
lengths (docs/distributed.md has the table) ``"head_tail"`` reaches 1.08
times the mean work at world 8 with ``alignment=1`` and 2.0 with
``alignment=16``; ``"rotated"`` stays within 1.05. ``"head_tail"`` is the
order of torch's ``_PerDocumentHeadTailLoadBalancer`` and of Megatron's
Transformer Engine partition (chunks ``r`` and ``2W - 1 - r`` of each
sequence); the two modes put the same columns on the same ranks for slots
of rotation 0, only the tokens inside a width move.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from packfn._ops._registry import device_assert, named_value
from packfn._ops.layout import pack_op
from packfn._ops.metadata import search_running_sums
from packfn._ops.scan import running_sum
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
    """Where every slot's chunks go, for the attention inputs of a balanced shard (all int64).

    Slot ``D`` (the last) is the row's padding after its documents.

    Attributes:
        widths: ``[batch, D + 1]``: each slot's width (its length rounded up
            to ``2 * world * alignment``; 0 for an absent slot), then the
            rest of ``budget``.
        lead: ``[batch, D + 1]``: padding columns before the slot's tokens
            in its width (``"rotated"``: width minus length; ``"head_tail"``: 0).
        rotation: ``[batch, D + 1]``: rank ``r`` keeps chunk pair
            ``(r + rotation) % world`` of the slot (0 for ``"head_tail"``).
        key_columns: ``[batch, budget]``: the width column of each gathered
            column (the rearrange indices of torch's load balancers).
        slots: ``[batch, local]``: the slot of each shard column, the same on
            every rank.
    """

    widths: torch.Tensor
    lead: torch.Tensor
    rotation: torch.Tensor
    key_columns: torch.Tensor
    slots: torch.Tensor


class _Slots(NamedTuple):
    """Per-slot tables derived from the widths (``[batch, D + 1]``, int64)."""

    chunk: torch.Tensor  # columns per chunk, width // (2 * world)
    start: torch.Tensor  # first width column
    local_start: torch.Tensor  # first shard column (start // world)


def _slot_tables(widths: torch.Tensor, world: int) -> _Slots:
    start = running_sum(F.pad(widths, (1, 0)))[:, :-1]
    return _Slots(widths // (2 * world), start, start // world)


def _slot_of(widths: torch.Tensor, count: int) -> torch.Tensor:
    """int64 ``[batch, count]``: the slot holding each of ``count`` columns (the widths sum to ``count``)."""
    batch, slots = widths.shape
    found = search_running_sums(widths, torch.arange(count, device=widths.device), right=True)
    return found - torch.arange(batch, device=widths.device).unsqueeze(1) * slots


def _inverse(source: torch.Tensor, width: int) -> torch.Tensor:
    """int64 ``[batch, width]``: the column of ``source`` that holds each value, -1 for values it lacks.

    ``source`` holds each value of ``[0, width)`` at most once and -1
    elsewhere; the -1 entries all land in one spare column, dropped.
    """
    batch, count = source.shape
    index = torch.where(source >= 0, source, width)
    positions = torch.arange(count, device=source.device).expand(batch, count)
    return torch.full((batch, width + 1), -1, dtype=torch.int64, device=source.device).scatter(1, index, positions)[
        :, :width
    ]


def _per_column(tables: list[torch.Tensor], index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each ``[batch, n]`` table read at ``index`` ``[batch, m]``, by one gather; each result contiguous."""
    stacked = torch.stack(tables, 1)
    return stacked.gather(2, index.unsqueeze(1).expand(-1, len(tables), -1)).unbind(1)


def _width_columns(
    tables: _Slots, lead: torch.Tensor, rotation: torch.Tensor, slots: torch.Tensor, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[batch, world * local]``, in gathered order: each column's width column, and the column of the
    width row with the tokens first that holds its token (``lead`` columns back; -1 for padding)."""
    local = slots.shape[1]
    start, chunk, local_start, rotation, lead = (
        table.unsqueeze(1)
        for table in _per_column([tables.start, tables.chunk, tables.local_start, rotation, lead], slots)
    )
    offset = torch.arange(local, device=slots.device) - local_start
    ranks = torch.arange(world, device=slots.device).view(1, world, 1)
    pair = (ranks + rotation) % world
    # The first `chunk` columns of a slot's block are the head chunk `pair`,
    # the next `chunk` its tail chunk `2 * world - 1 - pair`.
    within = torch.where(offset < chunk, pair * chunk + offset, (2 * world - 2 - pair) * chunk + offset)
    columns = start + within
    return columns.flatten(1), torch.where(within >= lead, columns - lead, -1).flatten(1)


def fit_message(unit: int, budget: int) -> str:
    """What the sync-free assert of a row that its balanced shards cannot hold says."""
    return (
        "shard_packed_batch: the documents of a row, each rounded up to a multiple of 2 * world * alignment "
        f"({named_value('unit', unit)}), do not fit {named_value('budget', budget)}: pack them with "
        "pad_to_multiple_of=2 * world * alignment"
    )


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
    assert that names the packer's ``pad_to_multiple_of``. ``rotate`` is
    ``"rotated"`` (padding first, pairs rotated), else ``"head_tail"``.
    """
    unit = 2 * world * alignment
    lengths = as_rows(seq_lens).to(torch.int64)
    batch, documents = lengths.shape
    # Clamped as aligned_layout's tables are, so that broken lengths report
    # their own rule there and no sum wraps.
    real = lengths.clamp(0, sequence_length + 1)
    widths = round_up(real, unit)
    used = widths.sum(1, keepdim=True)
    device_assert((used <= budget).all(), fit_message(unit, budget))
    # The width row with each slot's tokens at the start of its width.
    first = aligned_layout(seq_lens, seq_lens_padded, sequence_length=sequence_length, alignment=unit, budget=budget)
    rest = (budget - used).clamp_min(0)
    widths = torch.cat([widths, rest], 1)
    if rotate:
        lead = torch.cat([widths[:, :-1] - real, rest], 1)
        present = (lengths > 0).to(torch.int64).flatten()
        before = (present.cumsum(0) - present).view(batch, documents)
        rotation = F.pad(before % world, (0, 1))
    else:
        lead = rotation = torch.zeros_like(widths)
    local = budget // world
    tables = _slot_tables(widths, world)
    slots = _slot_of(widths // world, local)
    key_columns, source = _width_columns(tables, lead, rotation, slots, world)
    sources, positions, ids = _per_column(
        [first.source_indices, first.position_ids, first.sequence_ids], source.clamp_min(0)
    )
    padding = source < 0
    source_indices = sources.masked_fill(padding, -1)
    layout = PackedSequenceLayout(
        source_indices=source_indices,
        input_positions=_inverse(source_indices, sequence_length),
        position_ids=positions.masked_fill(padding, 0),
        sequence_ids=ids.masked_fill(padding, 0),
    )
    return layout, BalancePlan(widths, lead, rotation, key_columns, slots)


# ------------------------------------------------------------------ FlexAttention


def _first_real(lead: torch.Tensor, pair: torch.Tensor, chunk: torch.Tensor, world: int) -> torch.Tensor:
    """The first shard column, counted from the slot's block, whose width column is past ``lead`` (``2 * chunk``
    if none): the head chunk covers ``[pair * chunk, (pair + 1) * chunk)``, the tail chunk
    ``[(2W - 1 - pair) * chunk, (2W - pair) * chunk)``."""
    in_head = lead - pair * chunk
    in_tail = lead - (2 * world - 1 - pair) * chunk
    return torch.where(in_head < chunk, in_head.clamp_min(0), chunk + in_tail.clamp_min(0).minimum(chunk))


def balanced_kv_blocks(
    plan: BalancePlan, real: torch.Tensor, key_real: torch.Tensor, rank: int, world: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``BlockMask``'s tensors for one rank's queries against the gathered keys.

    NOTE [Blocks of a balanced shard]
    Every rank's shard has the same slots at the same shard columns (a
    slot's block starts at ``start // world`` on every rank), so a query
    block ``i`` and a key block ``j`` of any ranks can share a document only
    through the document that runs from one to the other: for ``i != j``
    that is the last document of the earlier block, which must be the first
    of the later one. Inside a slot, a rank's width columns grow with its
    shard columns (the head chunk precedes the tail chunk), so its real
    tokens are one run and the earliest real key of a document in a key
    block is at the later of the block's first column of that document and
    the document's first real column on the key rank; a query attends the
    block when that key is not after it. Diagonal blocks (``i == j``, any
    two ranks) compare each query with that key of its own document. A
    block pair is full when every query and key is real, both blocks lie in
    one document and the last key precedes the first query.
    ``O(batch * blocks**2 + batch * world * local)``, as :func:`packfn.document_block_mask`.

    Args:
        plan: The shard's :class:`BalancePlan`.
        real: bool ``[batch, local]``: the real queries of this rank.
        key_real: bool ``[batch, budget]``: the real gathered keys.
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
    tables = _slot_tables(plan.widths, world)
    local_start, chunk, rotation, lead = _per_column(
        [tables.local_start, tables.chunk, plan.rotation, plan.lead], slots
    )
    block_start = torch.arange(local, device=device) // block_size * block_size
    first_in_block = torch.maximum(local_start, block_start)
    run_end = torch.minimum(local_start + 2 * chunk, block_start + block_size)
    # Per key rank: the earliest real key of each column's document inside its block ([batch, world, local]).
    ranks = torch.arange(world, device=device).view(1, world, 1)
    pair = (ranks + rotation.unsqueeze(1)) % world
    first_real = local_start.unsqueeze(1) + _first_real(lead.unsqueeze(1), pair, chunk.unsqueeze(1), world)
    candidate = torch.maximum(first_in_block.unsqueeze(1), first_real)
    never = torch.iinfo(torch.int64).max
    earliest = torch.where(candidate < run_end.unsqueeze(1), columns.gather(2, candidate.clamp_max(local - 1)), never)
    diagonal = (real.unsqueeze(1) & (earliest <= mine.unsqueeze(1))).view(batch, world, blocks, block_size).any(-1)
    first_slot, last_slot = slots[:, ::block_size], slots[:, block_size - 1 :: block_size]

    def latest_real(slot: torch.Tensor) -> torch.Tensor:
        """``[batch, blocks]``: the latest width column of a real query of ``slot`` in each block, -1 if none."""
        own = real & (slots == slot.unsqueeze(2).expand(-1, -1, block_size).reshape(batch, local))
        return torch.where(own, mine, -1).view(batch, blocks, block_size).amax(-1)

    def pair_up(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return query.view(batch, blocks, 1, 1), key.view(batch, 1, 1, blocks)

    # Shape [batch, query block, key rank, key block].
    q_first, q_last = latest_real(first_slot), latest_real(last_slot)
    key_first, key_last = earliest[:, :, ::block_size], earliest[:, :, block_size - 1 :: block_size]
    q_slot, k_slot = pair_up(first_slot, last_slot)  # an earlier key block ends in the query block's first document
    before = (q_slot == k_slot) & (q_slot < documents) & (key_last.unsqueeze(1) <= q_first.view(batch, blocks, 1, 1))
    q_slot, k_slot = pair_up(last_slot, first_slot)  # a later key block begins in the query block's last document
    after = (q_slot == k_slot) & (q_slot < documents) & (key_first.unsqueeze(1) <= q_last.view(batch, blocks, 1, 1))
    query_block = torch.arange(blocks, device=device).view(1, blocks, 1, 1)
    key_block = torch.arange(blocks, device=device).view(1, 1, 1, blocks)
    on_diagonal = diagonal.transpose(1, 2).unsqueeze(-1)
    present = torch.where(key_block < query_block, before, torch.where(key_block > query_block, after, on_diagonal))
    single = (first_slot == last_slot) & (first_slot < documents)
    all_real = real.view(batch, blocks, block_size).all(-1)
    keys_real = key_real.view(batch, world, blocks, block_size).all(-1)
    earliest_query = mine.view(batch, blocks, block_size).amin(-1)
    latest_key = columns.view(batch, world, blocks, block_size).amax(-1)
    q_slot, k_slot = pair_up(first_slot, first_slot)
    full = (
        (all_real & single).view(batch, blocks, 1, 1)
        & single.view(batch, 1, 1, blocks)
        & keys_real.unsqueeze(1)
        & (q_slot == k_slot)
        & (latest_key.unsqueeze(1) <= earliest_query.view(batch, blocks, 1, 1))
    )
    partial = (present.expand(full.shape) & ~full).flatten(2).unsqueeze(1)
    return (*_ordered(partial), *_ordered(full.flatten(2).unsqueeze(1)))


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block counts and block indices, present blocks ascending first, as ``create_block_mask`` orders them."""
    dense = dense.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


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
    A rank holds two chunks of each slot, and each must see the keys of its
    document up to its own end. Their key ranges overlap (both start at the
    document's first token), which one ``cu_seqlens_k`` over the row cannot
    express; so the keys go into a buffer, and each chunk ``k`` (of ``c``
    columns, ``p_k`` of them padding before the slot's tokens) takes two
    segments: its ``p_k`` padding queries against their own ``p_k`` columns,
    then its other queries against the slot's tokens up to the chunk's end.
    With bottom-right causal alignment every real query sees exactly the
    earlier keys of its document, and no query row is empty. A chunk takes
    at most ``(k + 1) * c`` buffer columns, a slot at most ``(2W + 1) * c``,
    so ``key_length = budget + budget // (2 * world)`` per row, static, the
    rest a last segment without queries. A gathered key is copied into the
    buffer at most twice (the tail chunk's tokens repeat the head chunk's):
    the first table holds the head chunk's segments and the tail chunk's
    padding, the second the tail chunk's tokens, each copying a key at most
    once, so the buffer is two packs and its backward two restores: gathers,
    no atomics.

    Returns:
        ``cu_seqlens_q`` and ``cu_seqlens_k`` int32 ``[batch * (4 * (D + 1) + 1) + 1]``,
        ``max_seqlen_q`` and ``max_seqlen_k`` int32 0-d, and the
        :class:`BalancedKeys` that build the buffer.
    """
    widths, lead = plan.widths, plan.lead
    budget = plan.key_columns.shape[1]
    key_length = budget + budget // (2 * world)
    tables = _slot_tables(widths, world)
    chunk = tables.chunk
    head = (rank + plan.rotation) % world
    tail = 2 * world - 1 - head
    padding = [(lead - index * chunk).clamp_min(0).minimum(chunk) for index in (head, tail)]
    tokens = [((index + 1) * chunk - lead).clamp_min(0) for index in (head, tail)]
    # Per slot: [head padding, head tokens, tail padding, tail tokens], then one segment without queries.
    queries = torch.stack([padding[0], chunk - padding[0], padding[1], chunk - padding[1]], -1).flatten(1)
    keys = torch.stack([padding[0], tokens[0], padding[1], tokens[1]], -1).flatten(1)
    keys = torch.cat([keys, key_length - keys.sum(1, keepdim=True)], 1)
    queries = F.pad(queries, (0, 1))
    cu_seqlens_q = F.pad(queries.flatten().cumsum(0), (1, 0)).to(torch.int32)
    cu_seqlens_k = F.pad(keys.flatten().cumsum(0), (1, 0)).to(torch.int32)
    # Where each gathered key goes: the buffer columns of slot k start at `begin`, in the order of its segments.
    segments = keys[:, :-1].view(keys.shape[0], -1, 4)
    begin = running_sum(F.pad(segments.sum(-1), (1, 0)))[:, :-1]
    starts = begin.unsqueeze(-1) + running_sum(F.pad(segments, (1, 0)))[..., :-1]  # [batch, slots, 4]
    column_slots = plan.slots.repeat(1, world)
    per_slot = torch.stack([tables.start, chunk, lead, head, tail, padding[0], padding[1], *starts.unbind(-1)], 1)
    # One gather of every per-slot table ([batch, 11, slots]) for every gathered column, each row contiguous.
    index = column_slots.unsqueeze(1).expand(-1, per_slot.shape[1], -1)
    start, size, first_token, head, tail, head_padding, tail_padding, *segment_start = per_slot.gather(2, index).unbind(
        1
    )
    offset = plan.key_columns - start  # inside the slot's width
    head_first, tail_first = head * size, tail * size

    def within(first, end):
        return (offset >= first) & (offset < end)

    first_positions = torch.where(
        within(head_first, head_first + head_padding),
        segment_start[0] + offset - head_first,
        torch.where(
            within(first_token, head_first + size),
            segment_start[1] + offset - first_token,
            torch.where(within(tail_first, tail_first + tail_padding), segment_start[2] + offset - tail_first, -1),
        ),
    )
    second_positions = torch.where(within(first_token, tail_first + size), segment_start[3] + offset - first_token, -1)
    tables_out = BalancedKeys(
        _inverse(first_positions, key_length), first_positions, _inverse(second_positions, key_length), second_positions
    )
    return cu_seqlens_q, cu_seqlens_k, queries.max().to(torch.int32), keys.max().to(torch.int32), tables_out
