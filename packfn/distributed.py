"""Contiguous context parallelism and microbatch splits of packed batches.

A packed batch is laid out in aligned rows (:func:`packfn.aligned_layout`)
of a fixed row budget ``budget``. With context parallelism over ``world``
ranks, rank ``r`` keeps the query columns ``[r * local, (r + 1) * local)``
of every row, ``local = budget // world``, and attends the keys of the whole
row, which it gathers from every rank (:func:`gather_sequence`). Example,
``world=2``, ``alignment=2``, ``budget=8``, documents of 3 and 2 tokens::

    sequence_ids      = [[1, 1, 1, 0, 2, 2, 0, 0]]    (the whole row: keys)
    rank 0 (queries)  = [[1, 1, 1, 0]]                columns 0..3
    rank 1 (queries)  = [[2, 2, 0, 0]]                columns 4..7

Static API: :func:`shard_packed_batch` packs and shards tokens, labels, loss
mask, position ids, sequence ids and padding mask at the fixed ``budget``, so
every rank knows every length without a collective: no host read of a length
and no all-reduce of it (upstream's ``shard_cp_batch`` reads the longest row
back and all-reduces it when asked). :func:`cp_block_causal_mask`,
:func:`cp_document_block_mask` and :func:`cp_varlen_metadata` build the
local-query, global-key attention inputs of a rank from its
:class:`CPShard`.

Drop-ins: :func:`shard_cp_batch` (and :class:`ShardLayout`) and
:func:`gather_sequence`, the functions of
``nemo_automodel.components.models.deepseek_v41.cp`` 0.7.0 with their
signatures and results.

Microbatches: batch-major metadata (:func:`packfn.batch_metadata`) is
row-local, so a slice of its rows is a microbatch's metadata, except the
batch-wide ``max_seqlen``; :func:`split_batch_metadata` recomputes it per
microbatch.

NOTE [Why the budget is a multiple of world * alignment]
Each rank keeps ``budget // world`` columns. A multiple of ``alignment`` per
rank keeps every compression group (an aligned block of ``alignment``
columns) on one rank, as upstream's ``pad_multiple`` does; equal shard
lengths are what the all-gather of keys needs. So a budget that does not
divide is a ``ValueError`` on every rank (a static check, no collective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.nn.attention.flex_attention import BlockMask

from packfn._checks import check_positive_int
from packfn._ops import attention as _attention_ops
from packfn.attention import document_block_mask
from packfn.layout import PackedSequenceLayout, aligned_layout, packed_layout
from packfn.metadata import BatchMetadata

__all__ = [
    "CPShard",
    "CPVarlenMetadata",
    "ShardLayout",
    "cp_block_causal_mask",
    "cp_document_block_mask",
    "cp_varlen_metadata",
    "gather_sequence",
    "shard_cp_batch",
    "shard_packed_batch",
    "split_batch_metadata",
]

# torch 2.13 renamed the all-gathers (the old names warn there; torch 2.11 has only those).
_all_gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
_all_gather_autograd = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd


# ------------------------------------------------------------------ shard


class CPShard(NamedTuple):
    """One rank's contiguous query shard of a packed batch (``local = budget // world``).

    Attributes:
        input_ids: ``[batch, local]`` tokens, ``padding_token_id`` at padding (input dtype).
        labels: ``[batch, local]``, -100 at padding (input dtype).
        loss_mask: ``[batch, local]``, 0 at padding, or None when not given.
        position_ids: int64 ``[batch, local]``: position inside the document, 0 at padding.
        sequence_ids: int64 ``[batch, local]``: 1-based document slot, 0 at padding
            (upstream's ``packed_seq_ids``).
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
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    return rank, world


def _check_tokens(name: str, tensor: object, shape: tuple[int, int]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
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
            (0 and -1000 mark absent slots), as :func:`packfn.aligned_layout`.
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
    if not isinstance(seq_lens, torch.Tensor):
        raise TypeError(f"seq_lens must be a torch.Tensor, got {type(seq_lens).__name__}")
    rows = seq_lens.shape[0] if seq_lens.ndim == 2 else 1
    if seq_lens.ndim not in (1, 2) or rows != shape[0]:
        raise ValueError(
            f"seq_lens must be [batch, documents] with batch = {shape[0]} rows (or [documents] for one row), "
            f"got {tuple(seq_lens.shape)}"
        )
    if isinstance(padding_token_id, bool) or not isinstance(padding_token_id, int):
        raise TypeError(f"padding_token_id must be an int, got {type(padding_token_id).__name__}")
    if labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"labels must be an int32 or int64 tensor (padding is labelled -100), got {labels.dtype}")
    layout = aligned_layout(seq_lens, seq_lens_padded, sequence_length=shape[1], alignment=alignment, length=budget)
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


# --------------------------------------------------- local-query attention


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
    segments = _attention_ops.physical_varlen_metadata(keys * 2 + after)
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


# ----------------------------------------------------------------- gather

# Stable dtype codes for the shape check (Python's str hash differs per process).
_DTYPES = (
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
_MAX_AXES = 8


def _describe(tensor: torch.Tensor) -> list[int]:
    """Rank, dtype code, ``requires_grad`` and the first ``_MAX_AXES`` sizes (-1 past the rank)."""
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    shape = (list(tensor.shape) + [-1] * _MAX_AXES)[:_MAX_AXES]
    return [tensor.ndim, code, int(tensor.requires_grad), *shape]


def _spoken(row: list[int]) -> str:
    ndim, code, grad, *shape = row
    dtype = _DTYPES[code] if code < len(_DTYPES) else "another dtype"
    sizes = f"{ndim} axes" if ndim > _MAX_AXES else str(tuple(shape[:ndim]))
    return f"{sizes} {dtype}{' requiring grad' if grad else ''}"


def _gatherable(ndim: int | torch.Tensor) -> bool | torch.Tensor:
    return (ndim >= 2) & (ndim <= _MAX_AXES)


def _check_same_shapes(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Raise ``ValueError`` on every rank unless the group's tensors share shape, dtype and ``requires_grad``.

    NOTE [Shapes are checked before the gather]
    A gloo all-gather of shards of different sizes does not fail cleanly:
    one rank aborts the process (``gloo::EnforceNotMet``) and another returns
    garbage. So each eager gather first all-gathers a fixed-size descriptor
    (11 ints) and every rank raises the same error on a mismatch. Under
    torch.compile the shapes are those the graph was traced with; the check
    is one sync-free assert on the gathered descriptors instead. A rank
    whose tensor has too few or too many axes still sends its descriptor,
    so every rank raises together rather than one raising while the others
    wait in the gather (or pair it with a later call).
    """
    mine = torch.tensor(_describe(tensor), dtype=torch.int64, device=tensor.device)
    world = dist.get_world_size(group)
    everyone = _wait(_all_gather(mine, 0, group)).view(world, -1)
    if torch.compiler.is_compiling():
        torch._assert_async(
            (everyone == mine).all() & _gatherable(everyone[:, 0]).all(),
            "gather_sequence: shards differ in shape, dtype or requires_grad across ranks, "
            f"or have fewer than 2 or more than {_MAX_AXES} axes",
        )
        if not _gatherable(tensor.ndim):
            raise ValueError(f"tensor must have 2 to {_MAX_AXES} axes [batch, local_sequence, ...], got {tensor.ndim}")
        return
    rows = everyone.tolist()
    shapes = ", ".join(f"rank {rank}: {_spoken(row)}" for rank, row in enumerate(rows))
    if not all(_gatherable(row[0]) for row in rows):
        raise ValueError(
            f"gather_sequence takes tensors of 2 to {_MAX_AXES} axes [batch, local_sequence, ...]; got {shapes}"
        )
    if any(row != rows[0] for row in rows):
        raise ValueError(f"gather_sequence needs the same shape, dtype and requires_grad on every rank; got {shapes}")


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a functional collective's result (eager returns a lazy wrapper)."""
    return tensor.wait() if isinstance(tensor, fc.AsyncCollectiveTensor) else tensor


def gather_sequence(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, *, check_shapes: bool = True
) -> torch.Tensor:
    """Gather rank-ordered sequence shards along axis 1 (drop-in for upstream ``gather_sequence``).

    One functional all-gather, which traces under ``torch.compile(fullgraph=True)``.
    Floating tensors that require grad keep autograd: the backward sums
    every rank's gradient of a shard into its owner (a reduce-scatter).
    Other tensors are gathered without gradients.

    Args:
        tensor: ``[batch, local, ...]``, the same shape on every rank of ``group``.
        group: The context-parallel process group, or None (identity).
        check_shapes: Check first that every rank's shard has the same shape,
            dtype and ``requires_grad`` (NOTE [Shapes are checked before the
            gather]): one small all-gather more. Pass False on a hot path
            whose shapes are fixed by :func:`shard_packed_batch`.

    Returns:
        ``[batch, world * local, ...]``, rank 0's shard first. With no group
        or a group of one rank, ``tensor`` itself (aliased, as upstream).

    Raises:
        TypeError: ``tensor`` is not a tensor (on that rank only: it has no
            device to send a descriptor from).
        ValueError: (every rank, with ``check_shapes``) a shard with fewer
            than two or more than eight axes on any rank, or shards that
            differ in shape, dtype or ``requires_grad`` across ranks;
            without ``check_shapes``, fewer than two axes on this rank.
            Under torch.compile that check is a sync-free assert
            (``RuntimeError``) with the same meaning, raised before the gather.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    if check_shapes:
        _check_same_shapes(tensor, group)  # raises on every rank, a bad rank of axes included
    if tensor.ndim < 2:
        raise ValueError(f"tensor must have shape [batch, local_sequence, ...], got {tuple(tensor.shape)}")
    # Gathered along axis 0 ([world * batch, local, ...]) and moved into place
    # here: torch 2.11's Dynamo does not trace the functional collectives'
    # own regrouping for another axis (``_maybe_view_chunk_cat`` is skipped).
    gather = _all_gather_autograd if tensor.requires_grad else _all_gather
    stacked = _wait(gather(tensor.contiguous(), 0, group))
    world = dist.get_world_size(group)
    batch, local, *rest = tensor.shape
    return stacked.view(world, batch, local, *rest).transpose(0, 1).reshape(batch, world * local, *rest)


# ------------------------------------------------------- drop-in shard


@dataclass(frozen=True)
class ShardLayout:
    """What :func:`shard_cp_batch` learned about its layout (upstream's ``ShardLayout`` fields).

    Attributes:
        local_token_global_indices: int64 ``[padded_seq_len]`` without a mesh, else None.
        original_seq_len: Pre-pad sequence length; None for packed batches.
        padded_seq_len: Global sequence length after CP padding.
        input_row_shape: Always None here (flat-stream layouts only).
        input_token_stream_positions: int64 ``[batch, sequence]`` packed
            column of each input column, -1 where dropped (packed batches).
    """

    local_token_global_indices: torch.Tensor | None = None
    original_seq_len: int | None = None
    padded_seq_len: int | None = None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None


def _cp_rank(cp_mesh: Any) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group=cp_mesh.get_group())
    return cp_mesh.get_local_rank()


def _packed_length(batch: dict[str, Any], alignment: int, sync: bool) -> int:
    """Upstream's minimum packed length: the longest aligned row, at least the input row; MAX over WORLD if ``sync``."""
    lengths = batch["seq_lens"]
    aligned = (lengths.clamp_min(0) + alignment - 1) // alignment * alignment
    length = torch.maximum(aligned.sum(-1).max(), lengths.new_tensor(batch["input_ids"].shape[1]))
    if sync and dist.is_initialized():
        dist.all_reduce(length, op=dist.ReduceOp.MAX)
    return int(length)


def _pack_batch(batch: dict[str, Any], loss_mask, padding_token_id: int, alignment: int, sync: bool):
    """Upstream's packed step, on the copy ``batch``: pack token tensors, add ids, drop the length keys."""
    layout = packed_layout(
        batch["seq_lens"],
        seq_lens_padded=batch.get("seq_lens_padded"),
        input_shape=tuple(batch["input_ids"].shape),
        alignment=alignment,
        minimum_length=_packed_length(batch, alignment, sync),
    )
    for key, fill in (("input_ids", padding_token_id), ("labels", -100), ("loss_mask", 0)):
        if key in batch:
            batch[key] = layout.pack(batch[key], fill=fill)
    if loss_mask is not None:
        loss_mask = layout.pack(loss_mask)
    batch["position_ids"] = layout.position_ids
    batch["packed_seq_ids"] = layout.sequence_ids
    batch["padding_mask"] = layout.sequence_ids == 0
    for key in ("seq_lens", "seq_lens_padded", "qkv_format", "attention_mask"):
        batch.pop(key, None)
    return layout.input_positions, loss_mask


def _local(tensor: torch.Tensor, dim: int, start: int, stop: int, length: int, fill: Callable[[int, int], Any]):
    """Columns ``[start, stop)`` of ``tensor`` padded along ``dim`` past ``length`` by ``fill(first, count)``."""
    kept = tensor.narrow(dim, min(start, length), max(0, min(stop, length) - start))
    count = stop - max(start, length)
    if count <= 0:
        return kept.contiguous()
    return torch.cat((kept, fill(max(start, length) - length, count)), dim=dim)


def _constant(tensor: torch.Tensor, dim: int, value: Any) -> Callable[[int, int], torch.Tensor]:
    def fill(first: int, count: int) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[dim] = count
        return torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)

    return fill


def _continued(positions: torch.Tensor, dim: int) -> Callable[[int, int], torch.Tensor]:
    """Padding positions that count on from the last one (upstream's CP padding of ``position_ids``)."""

    def fill(first: int, count: int) -> torch.Tensor:
        last = positions.select(dim, positions.shape[dim] - 1).unsqueeze(dim)
        shape = [1] * positions.ndim
        shape[dim] = count
        steps = torch.arange(first + 1, first + count + 1, device=positions.device, dtype=positions.dtype)
        return last + steps.view(shape)

    return fill


def _padding_mask_from(attention_mask: torch.Tensor) -> torch.Tensor:
    if attention_mask.ndim == 4:
        diagonal = torch.diagonal(attention_mask[:, 0], dim1=-2, dim2=-1)
        return diagonal.logical_not() if attention_mask.dtype == torch.bool else diagonal != 0
    return attention_mask.bool().logical_not()


def _shard_contiguous(cp_mesh, batch: dict[str, Any], loss_mask, padding_token_id: int, pad_multiple: int, packed):
    """Upstream's contiguous CP shard on the copy ``batch``, reading only this rank's columns."""
    attention_mask = batch.pop("attention_mask", None)
    if attention_mask is not None and "padding_mask" not in batch:
        batch["padding_mask"] = _padding_mask_from(attention_mask)
    if "input_ids" not in batch:
        raise AssertionError("the CP dispatch requires exactly one of 'inputs_embeds' or 'input_ids' in batch")
    tokens = batch["input_ids"]
    batch_size, length = tokens.shape[:2]
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(length, device=tokens.device).unsqueeze(0).expand(batch_size, -1)
    elif batch["position_ids"].ndim == 2 and batch["position_ids"].shape[0] == 1 and batch_size > 1:
        batch["position_ids"] = batch["position_ids"].expand(batch_size, -1)
    positions = batch["position_ids"]
    position_dim = 2 if positions.ndim == 3 else 1
    labels = batch.get("labels")
    if labels is None and loss_mask is not None:
        labels, loss_mask = loss_mask, None
    if labels is None:
        raise KeyError("Context parallelism requires `labels` in the batch, or labels passed as `loss_mask`.")
    cp_size = cp_mesh.size()
    divisor = cp_size * max(int(pad_multiple or 1), 2)
    padded = length + (-length) % divisor
    local = padded // cp_size
    start = _cp_rank(cp_mesh) * local
    stop = start + local
    for key, value in (("input_ids", padding_token_id), ("padding_mask", True)):
        if key in batch:
            batch[key] = _local(batch[key], 1, start, stop, length, _constant(batch[key], 1, value))
    batch["labels"] = _local(labels, 1, start, stop, length, _constant(labels, 1, -100))
    batch["position_ids"] = _local(positions, position_dim, start, stop, length, _continued(positions, position_dim))
    if packed:
        ids = batch["packed_seq_ids"]
        batch["packed_seq_ids"] = _local(ids, 1, start, stop, length, _constant(ids, 1, 0))
    if loss_mask is not None:
        batch["loss_mask"] = _local(loss_mask, 1, start, stop, length, _constant(loss_mask, 1, 0))
    return ShardLayout(original_seq_len=length, padded_seq_len=padded)


def shard_cp_batch(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int | None = 0,
    pad_multiple: int = 1,
    packed_alignment: int = 1,
    sync_packed_length: bool = False,
) -> tuple[Callable[[], contextlib.AbstractContextManager], dict[str, Any], ShardLayout]:
    """Pack a batch and keep this rank's contiguous query shard (drop-in for upstream ``shard_cp_batch``).

    Same results as ``nemo_automodel.components.models.deepseek_v41.cp.shard_cp_batch``
    0.7.0: the packed row length is the longest aligned row, at least the
    input row (read back to the host, and all-reduced over WORLD with
    ``sync_packed_length``); the row is padded to a multiple of
    ``cp_size * max(pad_multiple, 2)`` and cut into contiguous shards. For a
    fixed budget with no host read and no collective, use
    :func:`shard_packed_batch`.

    Unlike upstream, the given ``batch`` dict is left unchanged (upstream
    replaces its entries in place and returns it): the result is a new dict
    with upstream's keys, in upstream's order, and upstream's values. Each
    rank reads only its own columns of the padded row.

    Args:
        cp_mesh: Context-parallel ``DeviceMesh``, or None for a local packed forward.
        tp_mesh: Tensor-parallel mesh (unused, as upstream).
        batch: ``input_ids``, ``labels``, optional ``position_ids`` and binary
            ``attention_mask`` ``[batch, sequence]``; packed input adds
            ``seq_lens`` and optional ``seq_lens_padded`` ``[batch, documents]``.
        loss_mask: Optional ``[batch, sequence]``.
        padding_token_id: Token used for padding; None means 0.
        pad_multiple: Per-rank shard length multiple (the compression-ratio LCM).
        packed_alignment: Document alignment of the packed layout.
        sync_packed_length: All-reduce the packed length (MAX) over WORLD.

    Returns:
        ``(contextlib.nullcontext, local_batch, ShardLayout)``. ``local_batch``
        holds ``[batch, local]`` ``input_ids``, ``labels``, ``position_ids``,
        (packed) ``packed_seq_ids``, ``loss_mask`` when given, bool
        ``attention_mask`` (True at real tokens) and ``cp_group``.

    Raises:
        ValueError: upstream's messages for image / embedding input, packed
            input without ``seq_lens``, and :func:`packfn.packed_layout`'s errors.
        KeyError: no ``labels`` and no ``loss_mask`` (with a mesh).
    """
    del tp_mesh
    if batch.get("pixel_values") is not None or batch.get("inputs_embeds") is not None:
        raise ValueError("DeepSeek V4.1 context parallelism currently supports text input_ids only")
    padding_token_id = 0 if padding_token_id is None else padding_token_id
    batch = dict(batch)
    packed = batch.get("seq_lens") is not None
    if not packed and (batch.get("cu_seqlens") is not None or batch.get("qkv_format") == "thd"):
        raise ValueError("DeepSeek V4.1 packed input requires [batch, sequence] tokens and seq_lens")
    input_positions = None
    if packed:
        input_positions, loss_mask = _pack_batch(
            batch, loss_mask, padding_token_id, packed_alignment, sync_packed_length
        )
    elif "padding_mask" not in batch and "attention_mask" not in batch:
        batch["padding_mask"] = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    if cp_mesh is None:
        if loss_mask is not None:
            batch["loss_mask"] = loss_mask
        length = batch["input_ids"].shape[1]
        device = batch["input_ids"].device
        layout = ShardLayout(padded_seq_len=length, local_token_global_indices=torch.arange(length, device=device))
    else:
        layout = _shard_contiguous(cp_mesh, batch, loss_mask, padding_token_id, pad_multiple, packed)
    if input_positions is not None:
        layout = ShardLayout(
            padded_seq_len=layout.padded_seq_len,
            local_token_global_indices=layout.local_token_global_indices,
            input_token_stream_positions=input_positions,
        )
    batch["attention_mask"] = ~batch.pop("padding_mask")
    batch["cp_group"] = None if cp_mesh is None else cp_mesh.get_group()
    return contextlib.nullcontext, batch, layout


# ------------------------------------------------------------- microbatches


def split_batch_metadata(metadata: BatchMetadata, num_microbatches: int) -> tuple[BatchMetadata, ...]:
    """Split batch-major metadata into microbatches along the batch axis, with no host sync.

    Rows of :class:`packfn.BatchMetadata` are row-local, so each microbatch
    takes its rows as they are (views, as ``torch.tensor_split`` cuts: sizes
    differ by at most one, the larger first); only the batch-wide
    ``max_seqlen`` is recomputed, from the microbatch's ``cu_seqlens``. Each
    result equals :func:`packfn.batch_metadata` of the microbatch's mask (same
    ``max_documents``), and :func:`packfn.flatten_metadata` of it is that
    microbatch's flat metadata.

    Args:
        metadata: :class:`packfn.BatchMetadata` of a ``[batch, sequence]`` mask.
        num_microbatches: Microbatches, in ``[1, batch]``.

    Returns:
        A tuple of ``num_microbatches`` :class:`packfn.BatchMetadata`.

    Raises:
        TypeError: ``metadata`` is not a ``BatchMetadata``.
        ValueError: ``num_microbatches`` outside ``[1, batch]``.
    """
    if not isinstance(metadata, BatchMetadata):
        raise TypeError(f"metadata must be a BatchMetadata (from batch_metadata), got {type(metadata).__name__}")
    num_microbatches = check_positive_int(num_microbatches, "num_microbatches")
    batch = metadata.cu_seqlens.shape[0]
    if num_microbatches > batch:
        raise ValueError(f"num_microbatches={num_microbatches} exceeds the batch of {batch} rows")
    parts = zip(
        torch.tensor_split(metadata.packed_token_indices, num_microbatches),
        torch.tensor_split(metadata.cu_seqlens, num_microbatches),
        torch.tensor_split(metadata.num_documents, num_microbatches),
        strict=True,
    )
    return tuple(
        BatchMetadata(indices, cu_seqlens, _longest(cu_seqlens), documents, metadata.max_seqlen_bound)
        for indices, cu_seqlens, documents in parts
    )


def _longest(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int32 0-d: the longest document of row-local boundaries (-1 past each row's last one), 0 without one.

    Differences past a row's last boundary are 0 (-1 after -1) or negative
    (-1 after the last boundary), so they never win the maximum; the clamp
    covers microbatches without a document.
    """
    return (cu_seqlens[:, 1:] - cu_seqlens[:, :-1]).max().clamp_min(0).to(torch.int32)
