"""A rank's attention inputs under context parallelism: its queries against the gathered keys.

Every function takes the :class:`packfn.distributed.CPShard` of
:func:`packfn.shard_packed_batch` and works for every ``balance``: the keys
are the whole row in gathered order (:func:`packfn.distributed.all_gather_sequence`
of every rank's shard), the queries are this rank's ``local`` columns.

- ``"block_causal"``: :func:`cp_block_causal_mask`, bool ``[batch, 1, local, budget]``;
- ``"block_mask"``: :func:`cp_document_block_mask`, a FlexAttention ``BlockMask``;
- ``"flash_varlen"``: :func:`cp_varlen_metadata`, boundaries for bottom-right
  causal varlen kernels and the keys they index;
- :func:`cp_attention_work`: the attended query-key pairs, to compare ranks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask

from packfn._checks import check_positive_int, check_tensor
from packfn._ops.metadata import binary_search_slots, compact
from packfn.distributed.balanced import BalancedKeys, balanced_kv_blocks, balanced_varlen
from packfn.distributed.cp import CPShard
from packfn.masks import document_block_mask

__all__ = [
    "CPVarlenMetadata",
    "cp_attention_work",
    "cp_block_causal_mask",
    "cp_document_block_mask",
    "cp_varlen_metadata",
]


def _check_shard(shard: object) -> CPShard:
    if not isinstance(shard, CPShard):
        raise TypeError(f"shard must be a CPShard (from shard_packed_batch), got {type(shard).__name__}")
    return shard


def cp_block_causal_mask(shard: CPShard) -> torch.Tensor:
    """Build this rank's rows of the block-causal mask: local queries against the gathered keys.

    Args:
        shard: This rank's :class:`CPShard`.

    Returns:
        Bool ``[batch, 1, local, budget]``: True where local query ``i`` may
        attend gathered key ``j``: same document, both real tokens, key not
        after the query in the document (``position_ids``). For
        ``balance="contiguous"``, rows ``start:start + local`` of
        :func:`packfn.block_causal_mask` of ``shard.key_sequence_ids``.

    Raises:
        TypeError: ``shard`` is not a :class:`CPShard`.
    """
    shard = _check_shard(shard)
    keys, queries = shard.key_sequence_ids, shard.sequence_ids
    # A real query's document holds only real keys before it, in the order of their positions.
    causal = shard.layout.position_ids.unsqueeze(1) <= shard.position_ids.unsqueeze(2)
    same = (queries.unsqueeze(2) == keys.unsqueeze(1)) & (queries != 0).unsqueeze(2)
    return (same & causal).unsqueeze(1)


def cp_document_block_mask(shard: CPShard, *, block_size: int = 128) -> BlockMask:
    """Build this rank's FlexAttention ``BlockMask``: ``local`` queries against ``budget`` gathered keys.

    Equal to ``create_block_mask`` of the ``mask_mod`` of
    :func:`cp_block_causal_mask` with ``Q_LEN=local``, ``KV_LEN=budget``,
    computed from per-block tables instead of every pair. Contiguous: the
    query blocks of :func:`packfn.document_block_mask` of the whole row;
    balanced: NOTE [Blocks of a balanced shard].

    Args:
        shard: This rank's :class:`CPShard`.
        block_size: Query and key block size; must divide ``local``.

    Returns:
        A ``BlockMask`` with ``kv_num_blocks`` int32 ``[batch, 1, local // block_size]``
        and ``kv_indices`` int32 ``[batch, 1, local // block_size, budget // block_size]``.

    Raises:
        TypeError: ``shard`` is not a :class:`CPShard`.
        ValueError: ``block_size`` is not positive or does not divide ``local``.
    """
    shard = _check_shard(shard)
    block_size = check_positive_int(block_size, "block_size")
    if shard.local % block_size != 0:
        raise ValueError(f"block_size={block_size} must divide the local shard length {shard.local}")
    start = shard.start
    lengths = (shard.local, shard.key_sequence_ids.shape[1])
    if shard.plan is None:
        whole = document_block_mask(shard.key_sequence_ids, block_size=block_size)
        blocks = slice(start // block_size, (start + shard.local) // block_size)
        row_mask_mod = whole.mask_mod

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return row_mask_mod(b, h, q_idx + start, kv_idx)

        tables = (whole.kv_num_blocks, whole.kv_indices, whole.full_kv_num_blocks, whole.full_kv_indices)
        tables = tuple(table[:, :, blocks] for table in tables)
        return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=lengths)
    ids, positions = shard.key_sequence_ids, shard.layout.position_ids

    def balanced_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        query = ids[b, q_idx + start]
        causal = positions[b, kv_idx] <= positions[b, q_idx + start]
        return (query == ids[b, kv_idx]) & (query != 0) & causal

    real, key_real = shard.sequence_ids != 0, shard.key_sequence_ids != 0
    tables = balanced_kv_blocks(shard.plan, real, key_real, shard.rank, shard.world, block_size)
    return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=block_size, mask_mod=balanced_mask_mod, seq_lengths=lengths)


class CPVarlenMetadata(NamedTuple):
    """Varlen inputs for local queries ``[batch * local]`` against keys ``[batch * key_length]``.

    Segment ``k`` pairs queries ``cu_seqlens_q[k]:cu_seqlens_q[k + 1]`` with
    keys ``cu_seqlens_k[k]:cu_seqlens_k[k + 1]``, causal aligned bottom-right
    (flash-attn >= 2.1, ``torch.nn.attention.varlen.varlen_attn`` with
    ``window_size=(-1, 0)``: the last query sees the last key). The keys are
    :meth:`keys` of the gathered keys, flattened.

    Attributes:
        cu_seqlens_q: int32 query boundaries ending at ``batch * local``.
            Contiguous: ``[batch * (min(2 * D, local - 1) + 3) + 1]`` for
            ``D = shard.max_documents``, the row's end repeated past its last
            segment; balanced: ``[batch * (4 * (D + 1) + 1) + 1]``, four
            segments per slot (the row's padding is the last slot, some
            segments empty) and one without queries per row.
        cu_seqlens_k: int32, the same shape: key boundaries over the flattened
            keys, ending at ``batch * key_length``.
        max_seqlen_q: int32 0-d.
        max_seqlen_k: int32 0-d.
        max_seqlen_q_bound: Python int ``local``.
        max_seqlen_k_bound: Python int ``budget``.
        key_length: Python int: keys per row, ``budget`` (contiguous) or
            ``budget + budget // (2 * world)`` (balanced, NOTE [Varlen keys of a balanced shard]).
        batch: Python int: rows.
        key_tables: How a balanced shard's key buffer reads the gathered keys; None for contiguous.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: torch.Tensor
    max_seqlen_k: torch.Tensor
    max_seqlen_q_bound: int
    max_seqlen_k_bound: int
    key_length: int
    batch: int
    key_tables: BalancedKeys | None = None

    def keys(self, gathered: torch.Tensor) -> torch.Tensor:
        """The keys (or values) that ``cu_seqlens_k`` indexes, from the gathered ones.

        Args:
            gathered: ``[batch, budget, ...]``, from :func:`all_gather_sequence`.

        Returns:
            ``[batch, key_length, ...]``: ``gathered`` itself for a contiguous
            shard; for a balanced one, each document's keys up to the end of
            this rank's head chunk, then up to the end of its tail chunk, by
            two gathers whose backward is two gathers (no atomics).

        Raises:
            TypeError / ValueError: ``gathered`` is not a ``[batch, budget, ...]`` tensor.
        """
        check_tensor(gathered, "gathered")
        tables = self.key_tables
        budget = self.max_seqlen_k_bound
        batch = self.batch
        if gathered.ndim < 2 or tuple(gathered.shape[:2]) != (batch, budget):
            shape = tuple(gathered.shape)
            raise ValueError(f"gathered must have shape [batch={batch}, budget={budget}, ...], got {shape}")
        return gathered if tables is None else tables.keys(gathered)


def cp_varlen_metadata(shard: CPShard) -> CPVarlenMetadata:
    """Build this rank's varlen boundaries, with static shapes and no host sync.

    Contiguous: every run of one sequence id (padding runs included, as
    :func:`packfn.physical_varlen_metadata`) that holds some of this rank's
    queries ``[start, start + local)`` is a segment, cut at ``start + local``;
    its queries are its columns inside that range, so each segment ends its
    keys at its last query: with bottom-right causal alignment every query
    sees exactly the earlier keys of its document. The keys before the
    first such run and after the queries are one segment each, without
    queries (kernels skip them), so a row takes ``min(2 * D, local - 1) + 3``
    segments (``D = shard.max_documents``), not one per column.

    Balanced: each of the rank's two chunks of a document is its own
    segment, against the document's keys up to the chunk's end, in the key
    buffer that :meth:`CPVarlenMetadata.keys` builds (NOTE [Varlen keys of a
    balanced shard]).

    Args:
        shard: This rank's :class:`CPShard`.

    Returns:
        :class:`CPVarlenMetadata`. For rank 1 of the contiguous example:
        ``cu_seqlens_k = [0, 4, 6, 8, 8, 8, 8]``, ``cu_seqlens_q = [0, 0, 2, 4, 4, 4, 4]``;
        for rank 0, ``cu_seqlens_k = [0, 3, 4, 8, 8, 8, 8]``, ``cu_seqlens_q = [0, 3, 4, 4, 4, 4, 4]``.

    Raises:
        TypeError: ``shard`` is not a :class:`CPShard`.
    """
    shard = _check_shard(shard)
    keys = shard.key_sequence_ids
    budget = keys.shape[1]
    if shard.plan is not None:
        cu_seqlens_q, cu_seqlens_k, max_q, max_k, tables = balanced_varlen(shard.plan, shard.rank, shard.world)
        key_length = tables.first_source.shape[1]
        batch = keys.shape[0]
        return CPVarlenMetadata(
            cu_seqlens_q, cu_seqlens_k, max_q, max_k, shard.local, budget, key_length, batch, tables
        )
    return _contiguous_varlen(keys, shard.start, shard.local, shard.max_documents)


def _contiguous_varlen(keys: torch.Tensor, start: int, local: int, max_documents: int) -> CPVarlenMetadata:
    """A contiguous shard's segments: runs of one id that hold queries, and one query-less run on either side.

    Row ``r``'s boundaries, in order: its first column; the first column of
    the run holding column ``start`` (the keys before it form one segment
    without queries); every run start inside ``(start, end)``; and ``end``
    (the keys from there on form one more). At most ``2 * D`` runs start
    after column 0 of a row of ``D`` documents, and at most ``local - 1``
    inside the queries, so ``min(2 * D, local - 1) + 3`` slots a row hold
    them all; the rest repeat the row's end (empty segments).
    """
    batch, budget = keys.shape
    end = start + local
    slots = min(2 * max_documents, local - 1) + 3
    columns = torch.arange(budget, device=keys.device)
    run_start = keys != torch.nn.functional.pad(keys, (1, 0), value=-1)[:, :-1]
    start_run = torch.where(run_start & (columns <= start), columns, 0).amax(1, keepdim=True)
    inside = run_start & (columns > start) & (columns < end)
    flags = (columns == 0) | (columns == start_run) | inside | (columns == end)
    found = compact(flags, columns.expand(batch, budget), slots, search=binary_search_slots(slots))
    used = torch.arange(slots, device=keys.device) < flags.sum(1, keepdim=True)
    rows = torch.arange(batch, device=keys.device).unsqueeze(1) * budget
    bounds = torch.cat([(rows + torch.where(used, found, budget)).flatten(), rows.new_full((1,), batch * budget)])
    first, last = bounds[:-1], bounds[1:]
    row = first - first % budget
    queries = (torch.minimum(last, row + end) - torch.maximum(first, row + start)).clamp_min(0)
    return CPVarlenMetadata(
        cu_seqlens_q=torch.nn.functional.pad(queries.cumsum(0), (1, 0)).to(torch.int32),
        cu_seqlens_k=bounds.to(torch.int32),
        max_seqlen_q=queries.max().to(torch.int32),
        max_seqlen_k=(last - first).max().to(torch.int32),
        max_seqlen_q_bound=local,
        max_seqlen_k_bound=budget,
        key_length=budget,
        batch=batch,
    )


def cp_attention_work(shard: CPShard) -> torch.Tensor:
    """Count the query-key pairs this rank's queries attend under block-causal attention, with no host read.

    A real query at position ``p`` of its document attends ``p + 1`` keys.
    Comparing the count across ranks (``max / mean``) measures the balance
    of a sharding.

    Args:
        shard: This rank's :class:`CPShard`.

    Returns:
        int64 ``[batch]``: attended pairs per row. For the contiguous example
        of this module, rank 0 attends 6 pairs (1 + 2 + 3) and rank 1 attends 3.

    Raises:
        TypeError: ``shard`` is not a :class:`CPShard`.
    """
    shard = _check_shard(shard)
    return torch.where(shard.padding_mask, 0, shard.position_ids + 1).sum(1)
