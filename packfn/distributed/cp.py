"""Contiguous context parallelism of packed batches, with static shapes and no host read.

A packed batch is laid out in aligned rows (:func:`packfn.aligned_layout`)
of a fixed row budget ``budget``. With context parallelism over ``world``
ranks, rank ``r`` keeps the query columns ``[r * local, (r + 1) * local)``
of every row, ``local = budget // world``, and attends the keys of the whole
row, which it gathers from every rank (:func:`all_gather_sequence`). Example,
``world=2``, ``alignment=2``, ``budget=8``, documents of 3 and 2 tokens::

    sequence_ids      = [[1, 1, 1, 0, 2, 2, 0, 0]]    (the whole row: keys)
    rank 0 (queries)  = [[1, 1, 1, 0]]                columns 0..3
    rank 1 (queries)  = [[2, 2, 0, 0]]                columns 4..7

Static API: :func:`shard_packed_batch` packs and shards tokens, labels, loss
mask, position ids, sequence ids and padding mask at the fixed ``budget``, so
every rank knows every length without a collective: no host read of a length
and no all-reduce of it. :func:`cp_block_causal_mask`,
:func:`cp_document_block_mask` and :func:`cp_varlen_metadata` build the
local-query, global-key attention inputs of a rank from its
:class:`CPShard`.

NeMo AutoModel's ``shard_cp_batch`` and ``gather_sequence``, reproduced
exactly, are in :mod:`packfn.nemo_automodel`.

NOTE [Why the budget is a multiple of world * alignment]
Each rank keeps ``budget // world`` columns. A multiple of ``alignment`` per
rank keeps every compression group (an aligned block of ``alignment``
columns) on one rank; equal shard
lengths are what the all-gather of keys needs. So a budget that does not
divide is a ``ValueError`` on every rank (a static check, no collective).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import BlockMask

from packfn._checks import check_int, check_positive_int, check_tensor
from packfn._compat import AsyncCollectiveTensor, all_gather, all_gather_autograd
from packfn._ops import varlen as _varlen_ops
from packfn.layout import PackedSequenceLayout, aligned_layout
from packfn.masks import document_block_mask

__all__ = [
    "CPShard",
    "CPVarlenMetadata",
    "cp_block_causal_mask",
    "cp_document_block_mask",
    "cp_varlen_metadata",
    "all_gather_sequence",
    "shard_packed_batch",
]


class CPShard(NamedTuple):
    """One rank's contiguous query shard of a packed batch (``local = budget // world``).

    Attributes:
        input_ids: ``[batch, local]`` tokens, ``padding_token_id`` at padding (input dtype).
        labels: ``[batch, local]``, -100 at padding (input dtype).
        loss_mask: ``[batch, local]``, 0 at padding, or None when not given.
        position_ids: int64 ``[batch, local]``: position inside the document, 0 at padding.
        sequence_ids: int64 ``[batch, local]``: 1-based document slot, 0 at padding.
        padding_mask: bool ``[batch, local]``: True at padding.
        key_sequence_ids: int64 ``[batch, budget]``: the sequence ids of the whole
            row, the keys every rank attends (``layout.sequence_ids``).
        layout: The :class:`packfn.PackedSequenceLayout` of the whole batch, to
            restore gathered outputs to the input columns.
        rank: This rank.
        world: Ranks in the context-parallel group.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor | None
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor
    padding_mask: torch.Tensor
    key_sequence_ids: torch.Tensor
    layout: PackedSequenceLayout
    rank: int
    world: int

    @property
    def local(self) -> int:
        """Query columns per rank, ``budget // world``."""
        return self.sequence_ids.shape[1]

    @property
    def start(self) -> int:
        """The first row column of this rank's queries, ``rank * local``."""
        return self.rank * self.local


def _check_rank(rank: int, world: int) -> tuple[int, int]:
    world = check_positive_int(world, "world")
    check_int(rank, "rank")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    return rank, world


def _check_tokens(name: str, tensor: object, shape: tuple[int, int]) -> None:
    check_tensor(tensor, name)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape [batch, sequence] = {list(shape)}, got {tuple(tensor.shape)}")


def _local_columns(values: torch.Tensor, source: torch.Tensor, fill: int | float) -> torch.Tensor:
    """``values`` ``[batch, sequence]`` read at ``source`` ``[batch, local]`` columns, ``fill`` where it is -1."""
    read = values.gather(1, source.clamp_min(0))
    return torch.where(source >= 0, read, torch.full_like(read, fill))


def shard_packed_batch(
    seq_lens: torch.Tensor,
    seq_lens_padded: torch.Tensor | None = None,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    rank: int,
    world: int,
    budget: int,
    alignment: int = 1,
    padding_token_id: int = 0,
) -> CPShard:
    """Pack a batch into aligned rows of ``budget`` columns and keep this rank's query shard, with no host sync.

    Every rank computes the layout of the whole batch (a few vectorized ops)
    and gathers only its own ``local = budget // world`` columns. All shapes
    follow from ``[batch, sequence]``, ``budget`` and ``world``: no length is
    read back and no collective runs, so it compiles into one graph that
    never recompiles across contents.

    Args:
        seq_lens: int32 or int64 ``[batch, documents]`` real document lengths
            (0 marks an absent slot), as :func:`packfn.aligned_layout`.
        seq_lens_padded: Physical spans of the same shape, or None.
        input_ids: ``[batch, sequence]`` tokens.
        labels: ``[batch, sequence]`` labels, already shifted within each document.
        loss_mask: Optional ``[batch, sequence]`` loss mask.
        rank: This rank, in ``[0, world)``.
        world: Ranks in the context-parallel group.
        budget: Aligned row length, a multiple of ``world * alignment``
            (NOTE [Why the budget is a multiple of world * alignment]).
        alignment: Alignment of document starts (the compression group).
        padding_token_id: Token written at padding.

    Returns:
        :class:`CPShard`. For the module example, rank 1 holds
        ``sequence_ids = [[2, 2, 0, 0]]`` and ``position_ids = [[0, 1, 0, 0]]``.

    Raises:
        TypeError: a non-tensor input or non-int static argument.
        ValueError: shapes that do not match, ``rank`` outside ``[0, world)``,
            or a ``budget`` that is not a multiple of ``world * alignment``.
        RuntimeError: (sync-free asserts) the data errors of
            :func:`packfn.aligned_layout`, documents that do not fit ``budget`` included.
    """
    rank, world = _check_rank(rank, world)
    alignment = check_positive_int(alignment, "alignment")
    budget = check_positive_int(budget, "budget")
    if budget % (world * alignment) != 0:
        raise ValueError(
            f"budget={budget} must be a multiple of world * alignment = {world} * {alignment} = {world * alignment}: "
            "each rank keeps budget // world columns, a whole number of aligned groups"
        )
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, sequence] tensor, got {shape}")
    shape = tuple(input_ids.shape)
    _check_tokens("labels", labels, shape)
    if loss_mask is not None:
        _check_tokens("loss_mask", loss_mask, shape)
    if shape[1] == 0:
        raise ValueError("input_ids must have at least one column")
    check_tensor(seq_lens, "seq_lens")
    rows = seq_lens.shape[0] if seq_lens.ndim == 2 else 1
    if seq_lens.ndim not in (1, 2) or rows != shape[0]:
        raise ValueError(
            f"seq_lens must be [batch, documents] with batch = {shape[0]} rows (or [documents] for one row), "
            f"got {tuple(seq_lens.shape)}"
        )
    check_int(padding_token_id, "padding_token_id")
    if labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"labels must be an int32 or int64 tensor (padding is labelled -100), got {labels.dtype}")
    layout = aligned_layout(seq_lens, seq_lens_padded, sequence_length=shape[1], alignment=alignment, budget=budget)
    local = budget // world
    columns = slice(rank * local, (rank + 1) * local)
    source = layout.source_indices[:, columns]
    sequence_ids = layout.sequence_ids[:, columns]
    return CPShard(
        input_ids=_local_columns(input_ids, source, padding_token_id),
        labels=_local_columns(labels, source, -100),
        loss_mask=None if loss_mask is None else _local_columns(loss_mask, source, 0),
        position_ids=layout.position_ids[:, columns],
        sequence_ids=sequence_ids,
        padding_mask=sequence_ids == 0,
        key_sequence_ids=layout.sequence_ids,
        layout=layout,
        rank=rank,
        world=world,
    )


def _check_shard(shard: object) -> CPShard:
    if not isinstance(shard, CPShard):
        raise TypeError(f"shard must be a CPShard (from shard_packed_batch), got {type(shard).__name__}")
    return shard


def cp_block_causal_mask(shard: CPShard) -> torch.Tensor:
    """Build this rank's rows of the block-causal mask: local queries against the whole row's keys.

    Args:
        shard: This rank's :class:`CPShard`.

    Returns:
        Bool ``[batch, 1, local, budget]``: True where local query ``i``
        (row column ``start + i``) may attend key ``j``: same document,
        ``j <= start + i``, both real tokens. Rows ``start:start + local`` of
        :func:`packfn.block_causal_mask` of ``shard.key_sequence_ids``.

    Raises:
        TypeError: ``shard`` is not a :class:`CPShard`.
    """
    shard = _check_shard(shard)
    keys = shard.key_sequence_ids
    queries = shard.sequence_ids
    device = keys.device
    query_positions = torch.arange(shard.start, shard.start + shard.local, device=device)
    causal = torch.arange(keys.shape[1], device=device) <= query_positions[:, None]
    same = (queries[:, :, None] == keys[:, None, :]) & (queries != 0)[:, :, None]
    return (same & causal).unsqueeze(1)


def cp_document_block_mask(shard: CPShard, *, block_size: int = 128) -> BlockMask:
    """Build this rank's FlexAttention ``BlockMask``: ``local`` queries against ``budget`` keys.

    The query blocks of this rank, taken from :func:`packfn.document_block_mask`
    of the whole row, with a ``mask_mod`` that offsets query indices by
    ``start``. Equal to ``create_block_mask`` of that ``mask_mod`` with
    ``Q_LEN=local``, ``KV_LEN=budget``.

    Args:
        shard: This rank's :class:`CPShard`.
        block_size: Query and key block size; must divide ``local``.

    Returns:
        A ``BlockMask`` with ``kv_num_blocks`` int32 ``[batch, 1, local // block_size]``
        and ``kv_indices`` int32 ``[batch, 1, local // block_size, blocks]``.

    Raises:
        TypeError: ``shard`` is not a :class:`CPShard`.
        ValueError: ``block_size`` is not positive or does not divide ``local``.
    """
    shard = _check_shard(shard)
    block_size = check_positive_int(block_size, "block_size")
    if shard.local % block_size != 0:
        raise ValueError(f"block_size={block_size} must divide the local shard length {shard.local}")
    whole = document_block_mask(shard.key_sequence_ids, block_size=block_size)
    blocks = slice(shard.start // block_size, (shard.start + shard.local) // block_size)
    start = shard.start
    row_mask_mod = whole.mask_mod

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return row_mask_mod(b, h, q_idx + start, kv_idx)

    return BlockMask.from_kv_blocks(
        whole.kv_num_blocks[:, :, blocks],
        whole.kv_indices[:, :, blocks],
        whole.full_kv_num_blocks[:, :, blocks],
        whole.full_kv_indices[:, :, blocks],
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(shard.local, shard.key_sequence_ids.shape[1]),
    )


class CPVarlenMetadata(NamedTuple):
    """Varlen inputs for local queries ``[batch * local]`` against gathered keys ``[batch * budget]``.

    Segment ``k`` pairs queries ``cu_seqlens_q[k]:cu_seqlens_q[k + 1]`` with
    keys ``cu_seqlens_k[k]:cu_seqlens_k[k + 1]``, causal aligned bottom-right
    (flash-attn >= 2.1: the last query sees the last key).

    Attributes:
        cu_seqlens_q: int32 ``[batch * budget + 1]``: query boundaries, then
            ``batch * local`` repeated.
        cu_seqlens_k: int32 ``[batch * budget + 1]``: key boundaries over the
            flattened gathered rows (every physical segment, cut at the end of
            this rank's queries), then ``batch * budget`` repeated.
        max_seqlen_q: int32 0-d.
        max_seqlen_k: int32 0-d.
        max_seqlen_q_bound: Python int ``local``.
        max_seqlen_k_bound: Python int ``budget``.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: torch.Tensor
    max_seqlen_k: torch.Tensor
    max_seqlen_q_bound: int
    max_seqlen_k_bound: int


def cp_varlen_metadata(shard: CPShard) -> CPVarlenMetadata:
    """Build this rank's varlen boundaries, with static shapes and no host sync.

    The keys are cut into physical segments (runs of one sequence id, padding
    runs included, as :func:`packfn.physical_varlen_metadata`) and once more
    at the end of this rank's queries, ``start + local``. A segment's queries
    are its columns inside ``[start, start + local)``, so each segment ends
    its keys at its last query or has no query: with bottom-right causal
    alignment every query sees exactly the earlier keys of its document.
    Segments before or after this rank's queries have no query (kernels skip
    them).

    Args:
        shard: This rank's :class:`CPShard`.

    Returns:
        :class:`CPVarlenMetadata`. For rank 1 of the module example:
        ``cu_seqlens_k = [0, 3, 4, 6, 8, 8, ...]``, ``cu_seqlens_q = [0, 0, 0, 2, 4, 4, ...]``.

    Raises:
        TypeError: ``shard`` is not a :class:`CPShard`.
    """
    shard = _check_shard(shard)
    keys = shard.key_sequence_ids
    budget = keys.shape[1]
    end = shard.start + shard.local
    # Doubling the ids and adding one from the end of the queries on makes
    # the id change at that column and nowhere else new.
    after = (torch.arange(budget, device=keys.device) >= end).to(keys.dtype)
    segments = _varlen_ops.physical_varlen_metadata_op(keys * 2 + after)
    bounds = segments.cu_seqlens.to(torch.int64)
    first, last = bounds[:-1], bounds[1:]
    row = torch.div(first, budget, rounding_mode="floor") * budget
    queries = (torch.minimum(last, row + end) - torch.maximum(first, row + shard.start)).clamp_min(0)
    cu_seqlens_q = torch.nn.functional.pad(queries.cumsum(0), (1, 0)).to(torch.int32)
    return CPVarlenMetadata(
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=segments.cu_seqlens,
        max_seqlen_q=queries.max().to(torch.int32),
        max_seqlen_k=segments.max_seqlen,
        max_seqlen_q_bound=shard.local,
        max_seqlen_k_bound=budget,
    )


# Stable dtype codes for the shape descriptors (Python's str hash differs per process).
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
MAX_AXES = 8


def describe(tensor: torch.Tensor) -> list[int]:
    """Rank, dtype code, ``requires_grad`` and the first ``MAX_AXES`` sizes (-1 past the rank)."""
    code = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else len(DTYPES)
    shape = (list(tensor.shape) + [-1] * MAX_AXES)[:MAX_AXES]
    return [tensor.ndim, code, int(tensor.requires_grad), *shape]


def gatherable(ndim: int | torch.Tensor) -> bool | torch.Tensor:
    """Whether a shard of ``ndim`` axes can be gathered (an int, or elementwise for a tensor)."""
    return (ndim >= 2) & (ndim <= MAX_AXES)


def shape_descriptors(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """int64 ``[world, 11]``: every rank's :func:`describe` of its shard, by one small all-gather.

    NOTE [Shapes are checked before the gather]
    A gloo all-gather of shards of different sizes does not fail cleanly:
    one rank aborts the process (``gloo::EnforceNotMet``) and another returns
    garbage. So a gather first all-gathers a fixed-size descriptor (11 ints)
    of each rank's shard, and every rank checks the same descriptors. A rank
    whose tensor has too few or too many axes still sends its descriptor,
    so every rank fails together rather than one failing while the others
    wait in the gather (or pair it with a later call).
    """
    mine = torch.tensor(describe(tensor), dtype=torch.int64, device=tensor.device)
    return wait(all_gather(mine, 0, group)).view(dist.get_world_size(group), -1)


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a functional collective's result (eager returns a lazy wrapper)."""
    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def all_gather_sequence(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, *, check_shapes: bool = True
) -> torch.Tensor:
    """Gather rank-ordered sequence shards along axis 1, with no host read.

    One functional all-gather, which traces under ``torch.compile(fullgraph=True)``.
    Floating tensors that require grad keep autograd: the backward sums
    every rank's gradient of a shard into its owner (a reduce-scatter).
    Other tensors are gathered without gradients.

    Args:
        tensor: ``[batch, local, ...]``, the same shape on every rank of ``group``.
        group: The context-parallel process group, or None (identity).
        check_shapes: Check first that every rank's shard has the same shape,
            dtype and ``requires_grad`` (NOTE [Shapes are checked before the
            gather]): one small all-gather more and a sync-free assert. Pass
            False on a hot path whose shapes are fixed by :func:`shard_packed_batch`.

    Returns:
        ``[batch, world * local, ...]``, rank 0's shard first. With no group
        or a group of one rank, ``tensor`` itself (aliased).

    Raises:
        TypeError: ``tensor`` is not a tensor (on that rank only: it has no
            device to send a descriptor from).
        RuntimeError: (``check_shapes``, a sync-free assert on every rank)
            shards that differ in shape, dtype or ``requires_grad`` across
            ranks, or have fewer than two or more than eight axes on any rank.
        ValueError: (without ``check_shapes``) fewer than two or more than
            eight axes on this rank.
    """
    check_tensor(tensor, "tensor")
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    if check_shapes:
        everyone = shape_descriptors(tensor, group)
        torch._assert_async(
            (everyone == everyone[:1]).all() & gatherable(everyone[:, 0]).all(),
            "all_gather_sequence: shards differ in shape, dtype or requires_grad across ranks, "
            f"or have fewer than 2 or more than {MAX_AXES} axes",
        )
    return gather_checked(tensor, group)


def gather_checked(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """:func:`all_gather_sequence` past the descriptor check."""
    if not gatherable(tensor.ndim):
        raise ValueError(f"tensor must have 2 to {MAX_AXES} axes [batch, local_sequence, ...], got {tensor.ndim}")
    # Gathered along axis 0 ([world * batch, local, ...]) and moved into place
    # here: torch 2.11's Dynamo does not trace the functional collectives'
    # own regrouping for another axis (``_maybe_view_chunk_cat`` is skipped).
    gather = all_gather_autograd if tensor.requires_grad else all_gather
    stacked = wait(gather(tensor.contiguous(), 0, group))
    world = dist.get_world_size(group)
    batch, local, *rest = tensor.shape
    return stacked.view(world, batch, local, *rest).transpose(0, 1).reshape(batch, world * local, *rest)
