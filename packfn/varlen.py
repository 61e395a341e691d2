"""Varlen inputs of a packed batch: physical boundaries over the flattened stream, and unpad / pad.

The packing format is described once, in :mod:`packfn.metadata`. For
the example mask ``[[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]``:

- ``"flash_varlen"`` (:data:`packfn.AttentionInputKind`): physical boundaries over
  the flattened ``[batch * sequence]`` stream, padding runs included
  (:func:`physical_varlen_metadata`): ``[0, 2, 5, 6, 10, 12]``, then 12
  repeated to a fixed size.
- :func:`unpad` and :func:`pad` move activations between ``[batch, sequence, ...]``
  and the varlen token order of :func:`packfn.varlen_metadata` (valid tokens
  first): ``unpad`` puts tokens ``0 1 2 3 4 6 7 8 9`` in rows 0 to 8.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from packfn._checks import check_mask, check_positive_int, check_same_device, check_tensor
from packfn._ops import varlen as _ops
from packfn._ops._registry import assert_rules
from packfn.metadata import VarlenMetadata

__all__ = ["PhysicalVarlenMetadata", "flash_kwargs", "pad", "physical_varlen_metadata", "unpad"]


class PhysicalVarlenMetadata(NamedTuple):
    """Physical varlen boundaries over the flattened ``[batch * sequence]`` stream (fixed capacity).

    Attributes:
        cu_seqlens: int32 ``[batch * sequence + 1]``: segment boundaries (a
            segment starts at every row start and wherever the id changes,
            padding runs included), ending at ``batch * sequence`` and padded
            with ``batch * sequence`` repeated (empty trailing segments).
        max_seqlen: int32 0-d: the longest segment.
        num_segments: int64 0-d: the number of segments.
        max_seqlen_bound: Python int ``sequence``, a static bound of ``max_seqlen``.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: torch.Tensor
    num_segments: torch.Tensor
    max_seqlen_bound: int


def physical_varlen_metadata(document_ids: torch.Tensor) -> PhysicalVarlenMetadata:
    """Build the ``flash_varlen`` boundaries of a packed batch, with static shapes and no host sync.

    Varlen kernels then run on ``x.reshape(batch * sequence, ...)`` without
    unpadding (the HF ``cu_seq_lens_q`` path); padding runs attend only among
    themselves.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids, of
            any integer dtype (uint16, uint32 and uint64 are read by their
            bits: only equality matters).

    Returns:
        :class:`PhysicalVarlenMetadata`. For the example mask:
        ``cu_seqlens = [0, 2, 5, 6, 10, 12, 12, ..., 12]`` (13 entries),
        ``max_seqlen = 4``, ``num_segments = 5``.

    Raises:
        ValueError: the mask is not a non-empty ``[batch, sequence]`` integer
            or bool tensor. Any ids are valid: segments are runs of equal
            ids, whatever their values or order (as upstream's).
    """
    ids = physical_ids(document_ids, "document_ids")
    return PhysicalVarlenMetadata(*_ops.physical_varlen_metadata_op(ids), document_ids.shape[1])


_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
"""Unsigned dtypes most of torch's kernels lack, and the signed ones of their width that carry their bits."""


def _bits(values: torch.Tensor) -> torch.Tensor:
    """``values`` of a dtype in :data:`_SIGNED` viewed as its signed twin (same bits, same equalities); else as is."""
    return values.view(_SIGNED[values.dtype]) if values.dtype in _SIGNED else values


def physical_ids(document_ids: object, name: str) -> torch.Tensor:
    """Checked ``[batch, sequence]`` ids of any integer dtype or bool, in one the ops take, with the same runs.

    Physical segments are runs of equal ids, so any integer ids do, as
    upstream's: uint16, uint32 and uint64 are read by their bits as the
    signed dtype of their width.
    """
    check_tensor(document_ids, name)
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex:
        raise ValueError(f"{name} must hold integer or bool document ids (any integer dtype), got {document_ids.dtype}")
    return check_mask(_bits(document_ids), name=name)


def flash_kwargs(cu_seqlens: torch.Tensor, max_length) -> dict[str, torch.Tensor | int]:
    """transformers' varlen keyword arguments (``FlashAttentionKwargs``) of self-attention over one layout.

    ``cu_seq_lens_q`` and ``cu_seq_lens_k`` are the same tensor, ``max_length_q``
    and ``max_length_k`` the same int (a bound works: varlen kernels size
    their grids by it).
    """
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }


def _check_varlen_metadata(metadata: VarlenMetadata) -> tuple[torch.Tensor, torch.Tensor, int]:
    indices = getattr(metadata, "indices", None)
    num_tokens = getattr(metadata, "num_tokens", None)
    sequence = getattr(metadata, "max_seqlen_bound", None)
    if not isinstance(indices, torch.Tensor) or not isinstance(num_tokens, torch.Tensor):
        raise TypeError(f"metadata must be a VarlenMetadata (from varlen_metadata), got {type(metadata).__name__}")
    if indices.ndim != 1 or indices.dtype != torch.int64:
        raise ValueError(
            f"metadata.indices must be int64 [batch * sequence], got {indices.dtype} {tuple(indices.shape)}"
        )
    if num_tokens.ndim != 0 or num_tokens.dtype.is_floating_point or num_tokens.dtype == torch.bool:
        raise ValueError(
            f"metadata.num_tokens must be a 0-d integer tensor, got {num_tokens.dtype} {tuple(num_tokens.shape)}"
        )
    sequence = check_positive_int(sequence, "metadata.max_seqlen_bound")
    if indices.numel() % sequence != 0:
        raise ValueError(
            f"metadata.indices has {indices.numel()} entries, not a multiple of max_seqlen_bound={sequence}"
        )
    return indices, num_tokens, sequence


def _check_values(values: object, minimum_rank: int) -> None:
    check_tensor(values, "values")
    if values.ndim < minimum_rank:
        shape = "[batch, sequence, ...]" if minimum_rank == 2 else "[batch * sequence, ...]"
        raise ValueError(f"values must have shape {shape}, got {tuple(values.shape)}")


def unpad(values: torch.Tensor, metadata: VarlenMetadata) -> torch.Tensor:
    """Move activations into varlen token order: valid tokens first, then zeros.

    NOTE [Unpad and pad are each other's backward] in :mod:`packfn._ops.varlen`.

    Args:
        values: ``[batch, sequence, ...]``, any dtype.
        metadata: :class:`packfn.VarlenMetadata` of the batch's mask, as
            :func:`varlen_metadata` made it: ``unpad`` reads it unchecked
            (an edited ``num_tokens`` moves that many rows), :func:`pad`
            checks it.

    Returns:
        ``[batch * sequence, ...]``: row ``i < num_tokens`` is valid token
        ``i`` (in ``cu_seqlens`` order), later rows are zeros. Gradients
        flow to valid tokens; padding tokens get zero gradient.

    Raises:
        TypeError / ValueError: ``values`` not ``[batch, sequence, ...]`` of
            the mask, or malformed metadata.
    """
    _check_values(values, 2)
    indices, num_tokens, sequence = _check_varlen_metadata(metadata)
    check_same_device(values, "values", indices, "metadata")
    if values.shape[1] != sequence or values.shape[0] * sequence != indices.numel():
        raise ValueError(
            f"values {tuple(values.shape)} do not match the mask's [batch, sequence] = "
            f"[{indices.numel() // sequence}, {sequence}]"
        )
    unpadded = _ops.unpad_op(_bits(values), indices, num_tokens)  # index_select lacks uint16/32/64; zero is zero
    return unpadded.view(values.dtype) if unpadded.dtype != values.dtype else unpadded


def pad(values: torch.Tensor, metadata: VarlenMetadata) -> torch.Tensor:
    """Move activations from varlen token order back to ``[batch, sequence, ...]``, zeros at padding.

    Rows of ``values`` past ``num_tokens`` are never read into the result:
    the uninitialized tail a varlen kernel leaves (even NaN) does not leak.

    Args:
        values: ``[batch * sequence, ...]`` in varlen token order (as
            :func:`unpad` returns), any dtype.
        metadata: :class:`packfn.VarlenMetadata` of the batch's mask.

    Returns:
        ``[batch, sequence, ...]``: valid tokens in place, exact zeros at padding.

    Raises:
        TypeError / ValueError: ``values`` not ``[batch * sequence, ...]``, or
            malformed metadata.
        RuntimeError: (asynchronously on a GPU) ``indices`` is not the varlen permutation.
    """
    _check_values(values, 1)
    indices, num_tokens, sequence = _check_varlen_metadata(metadata)
    check_same_device(values, "values", indices, "metadata")
    if values.shape[0] != indices.numel():
        raise ValueError(f"values {tuple(values.shape)} must have batch * sequence = {indices.numel()} rows")
    padded, broken = _ops.pad_op(_bits(values), indices, num_tokens, sequence)  # by their bits, as in unpad
    assert_rules(broken, _ops.PAD_RULES)
    return padded.view(values.dtype) if padded.dtype != values.dtype else padded
