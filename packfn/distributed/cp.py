"""Context parallelism of packed batches, with static shapes and no host read.

A packed batch is laid out in aligned rows (:func:`packfn.aligned_layout`)
of a fixed row budget ``budget``. With context parallelism over ``world``
ranks, every rank keeps ``local = budget // world`` query columns of every
row and attends the keys of the whole row, which it gathers from every rank
(:func:`all_gather_sequence`). ``balance`` chooses which columns:

- ``"rotated"`` (the default) and ``"head_tail"``: per-document head-tail
  shards, which give every rank an equal share of the causal attention
  work (:mod:`packfn.distributed.balanced`, with examples);
- ``"contiguous"``: rank ``r`` keeps columns ``[r * local, (r + 1) * local)``.
  Example, ``world=2``, ``alignment=2``, ``budget=8``, documents of 3 and 2
  tokens::

    sequence_ids      = [[1, 1, 1, 0, 2, 2, 0, 0]]    (the whole row: keys)
    rank 0 (queries)  = [[1, 1, 1, 0]]                columns 0..3
    rank 1 (queries)  = [[2, 2, 0, 0]]                columns 4..7

Static API: :func:`shard_packed_batch` packs and shards tokens, labels, loss
mask, position ids, sequence ids and padding mask at the fixed ``budget``, so
every rank knows every length without a collective: no host read of a length
and no all-reduce of it. :func:`cp_block_causal_mask`,
:func:`cp_document_block_mask` and :func:`cp_varlen_metadata` build the
local-query, global-key attention inputs of a rank from its
:class:`CPShard`; :func:`cp_attention_work` counts its attended pairs.

NeMo AutoModel's ``shard_cp_batch`` and ``gather_sequence``, reproduced
exactly, are in :mod:`packfn.nemo_automodel`.

NOTE [Why the budget is a multiple of world * alignment]
Each rank keeps ``budget // world`` columns. A multiple of ``alignment`` per
rank keeps every compression group (an aligned block of ``alignment``
columns) on one rank; equal shard lengths are what the all-gather of keys
needs. A balanced shard cuts every document and the row's padding into
``2 * world`` chunks of whole groups, so there the budget is a multiple of
``2 * world * alignment``. A budget that does not divide is a
``ValueError`` on every rank (a static check, no collective).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from packfn._checks import check_int, check_positive_int, check_same_device, check_scalar_fits, check_tensor
from packfn._compat import AsyncCollectiveTensor, all_gather, all_gather_autograd
from packfn._ops._registry import device_assert
from packfn.distributed.balanced import BALANCES, BalancePlan, balanced_layout
from packfn.layout import PackedSequenceLayout, aligned_layout

__all__ = [
    "CPShard",
    "all_gather_sequence",
    "shard_packed_batch",
]


class CPShard(NamedTuple):
    """One rank's query shard of a packed batch (``local = budget // world``).

    The gathered order of the row is the shards of ranks 0, 1, ... one
    after the other, what :func:`all_gather_sequence` returns; for
    ``balance="contiguous"`` it is the row itself.

    Attributes:
        input_ids: ``[batch, local]`` tokens, ``padding_token_id`` at padding (input dtype).
        labels: ``[batch, local]``, -100 at padding (input dtype).
        loss_mask: ``[batch, local]``, 0 at padding, or None when not given.
        position_ids: int64 ``[batch, local]``: position inside the document, 0 at padding.
        sequence_ids: int64 ``[batch, local]``: 1-based document slot, 0 at padding.
        padding_mask: bool ``[batch, local]``: True at padding.
        key_sequence_ids: int64 ``[batch, budget]``: the sequence ids of the
            whole row in gathered order, the keys every rank attends
            (``layout.sequence_ids``).
        layout: The :class:`packfn.PackedSequenceLayout` of the whole batch
            in gathered order: ``layout.restore`` of gathered outputs gives
            the input columns, ``layout.position_ids`` the keys' positions.
        rank: This rank.
        world: Ranks in the context-parallel group.
        max_documents: Document slots per row (``seq_lens``' last axis):
            the keys hold at most this many documents a row.
        balance: ``"rotated"``, ``"head_tail"`` or ``"contiguous"``.
        plan: Where each document's chunks go (:class:`packfn.distributed.balanced.BalancePlan`),
            None for ``"contiguous"``.
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
    max_documents: int
    balance: str = "contiguous"
    plan: BalancePlan | None = None

    @property
    def local(self) -> int:
        """Query columns per rank, ``budget // world``."""
        return self.sequence_ids.shape[1]

    @property
    def start(self) -> int:
        """The first gathered column of this rank's queries, ``rank * local``."""
        return self.rank * self.local


def _check_rank(rank: int, world: int) -> tuple[int, int]:
    world = check_positive_int(world, "world")
    check_int(rank, "rank")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    return rank, world


def _check_tokens(name: str, tensor: object, input_ids: torch.Tensor) -> None:
    check_tensor(tensor, name)
    if tensor.shape != input_ids.shape:
        raise ValueError(
            f"{name} must have shape [batch, sequence] = {list(input_ids.shape)}, got {tuple(tensor.shape)}"
        )
    check_same_device(tensor, name, input_ids, "input_ids")


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
    balance: str = "rotated",
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
        budget: Row length: a multiple of ``world * alignment`` for
            ``"contiguous"``, of ``2 * world * alignment`` for the balanced
            shards (NOTE [Why the budget is a multiple of world * alignment]).
        alignment: Alignment of document starts (the compression group).
        padding_token_id: Token written at padding, a value ``input_ids``' dtype holds.
        balance: ``"rotated"`` (default): per-document head-tail chunks, each
            document's padding before its tokens and its chunk pair rotated
            from one document to the next (NOTE [Padding first, pairs
            rotated]); ``"head_tail"``: chunks ``rank`` and
            ``2 * world - 1 - rank`` of every document, tokens first (torch's
            and Megatron's order); ``"contiguous"``: columns
            ``[rank * local, (rank + 1) * local)``. A balanced shard rounds
            each document up to ``2 * world * alignment`` columns: pack with
            ``pad_to_multiple_of=2 * world * alignment`` and
            ``budget=sequence`` so that every batch fits.

    Returns:
        :class:`CPShard`. For the contiguous example of this module, rank 1
        holds ``sequence_ids = [[2, 2, 0, 0]]`` and ``position_ids = [[0, 1, 0, 0]]``.

    Raises:
        TypeError: a non-tensor input or non-int static argument.
        ValueError: shapes that do not match, tensors on two devices, a
            ``padding_token_id`` ``input_ids``' dtype cannot hold, ``rank`` outside ``[0, world)``,
            an unknown ``balance``, or a ``budget`` that is not a multiple of
            ``world * alignment`` (``2 * world * alignment`` when balanced).
        RuntimeError: (sync-free asserts) the data errors of
            :func:`packfn.aligned_layout`, documents that do not fit ``budget`` included.
    """
    rank, world = _check_rank(rank, world)
    alignment = check_positive_int(alignment, "alignment")
    budget = check_positive_int(budget, "budget")
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {', '.join(map(repr, BALANCES))}, got {balance!r}")
    if balance == "contiguous" and budget % (world * alignment) != 0:
        raise ValueError(
            f"budget={budget} must be a multiple of world * alignment = {world} * {alignment} = {world * alignment}: "
            "each rank keeps budget // world columns, a whole number of aligned groups"
        )
    if balance != "contiguous" and budget % (2 * world * alignment) != 0:
        raise ValueError(
            f"budget={budget} must be a multiple of 2 * world * alignment = 2 * {world} * {alignment} = "
            f"{2 * world * alignment} for balance={balance!r}: the row's padding is cut into 2 * world chunks "
            "of whole aligned groups"
        )
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, sequence] tensor, got {shape}")
    shape = tuple(input_ids.shape)
    _check_tokens("labels", labels, input_ids)
    if loss_mask is not None:
        _check_tokens("loss_mask", loss_mask, input_ids)
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
    check_scalar_fits(padding_token_id, input_ids.dtype, "padding_token_id")
    check_same_device(seq_lens, "seq_lens", input_ids, "input_ids")
    if labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"labels must be an int32 or int64 tensor (padding is labelled -100), got {labels.dtype}")
    plan = None
    if balance == "contiguous":
        layout = aligned_layout(seq_lens, seq_lens_padded, sequence_length=shape[1], alignment=alignment, budget=budget)
    else:
        layout, plan = balanced_layout(
            seq_lens,
            seq_lens_padded,
            sequence_length=shape[1],
            alignment=alignment,
            budget=budget,
            world=world,
            rotate=balance == "rotated",
        )
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
        max_documents=seq_lens.shape[-1],
        balance=balance,
        plan=plan,
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
        device_assert(
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
