"""NeMo AutoModel's context-parallel helpers (``models.deepseek_v41.cp`` 0.7.0), exactly.

``shard_cp_batch`` reads the longest packed row back to the host (and
all-reduces it when asked), as upstream does; ``gather_sequence`` checks the
ranks' shapes in eager with a ``ValueError`` naming each rank's shard. The
static forms, with a fixed budget and no host read, are
:func:`packfn.shard_packed_batch` and :func:`packfn.distributed.all_gather_sequence`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from packfn._checks import check_scalar_fits, check_tensor
from packfn._utils import round_up
from packfn.distributed import cp as _cp
from packfn.nemo_automodel.layout import packed_layout

__all__ = ["ShardLayout", "gather_sequence", "shard_cp_batch"]


def gather_sequence(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, *, check_shapes: bool = True
) -> torch.Tensor:
    """Gather rank-ordered sequence shards along axis 1 (drop-in for upstream ``gather_sequence``).

    As :func:`packfn.distributed.all_gather_sequence`, but in eager the shape
    check reads every rank's descriptor back and raises ``ValueError`` on
    every rank, naming each rank's shard (NOTE [Shapes are checked before
    the gather] in :mod:`packfn.distributed.cp`); under ``torch.compile`` it
    is the static form's sync-free assert.

    Args:
        tensor: ``[batch, local, ...]``, the same shape on every rank of ``group``.
        group: The context-parallel process group, or None (identity).
        check_shapes: Check the ranks' shapes first (one small all-gather more).

    Returns:
        ``[batch, world * local, ...]``, rank 0's shard first. With no group
        or a group of one rank, ``tensor`` itself (aliased, as upstream).

    Raises:
        TypeError: ``tensor`` is not a tensor (on that rank only).
        ValueError: (every rank, with ``check_shapes``) a shard with fewer
            than two or more than eight axes on any rank, or shards that
            differ in shape, dtype or ``requires_grad`` across ranks;
            without ``check_shapes``, fewer than two axes on this rank.
    """
    check_tensor(tensor, "tensor")
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    if torch.compiler.is_compiling():
        return _cp.all_gather_sequence(tensor, group, check_shapes=check_shapes)
    if check_shapes:
        rows = _cp.shape_descriptors(tensor, group).tolist()
        shapes = ", ".join(f"rank {rank}: {_described(row)}" for rank, row in enumerate(rows))
        if not all(_cp.gatherable(row[0]) for row in rows):
            raise ValueError(
                f"gather_sequence takes tensors of 2 to {_cp.MAX_AXES} axes [batch, local_sequence, ...]; got {shapes}"
            )
        if any(row != rows[0] for row in rows):
            raise ValueError(
                f"gather_sequence needs the same shape, dtype and requires_grad on every rank; got {shapes}"
            )
    elif tensor.ndim < 2:
        raise ValueError(f"tensor must have shape [batch, local_sequence, ...], got {tuple(tensor.shape)}")
    return _cp.gather_checked(tensor, group)


def _described(row: list[int]) -> str:
    """A shard descriptor (:func:`packfn.distributed.cp.describe`) in words."""
    ndim, code, grad, *shape = row
    dtype = _cp.DTYPES[code] if code < len(_cp.DTYPES) else "another dtype"
    sizes = f"{ndim} axes" if ndim > _cp.MAX_AXES else str(tuple(shape[:ndim]))
    return f"{sizes} {dtype}{' requiring grad' if grad else ''}"


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
    aligned = round_up(lengths.clamp_min(0), alignment)
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
    if isinstance(batch.get("input_ids"), torch.Tensor):  # named here, not as pack's fill or torch.full's value
        check_scalar_fits(padding_token_id, batch["input_ids"].dtype, "padding_token_id")
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
