"""Document-id masks to varlen metadata, with fixed capacity and no host sync.

The packing format (every docstring in packfn refers to it; docs/format.md says more): ``document_ids`` is
``[batch, sequence]``, integer or bool. ``0`` is padding; a positive value is
the 1-based id of the document the token belongs to, local to its row. Ids
never decrease along a row (padding may sit anywhere, even inside a
document), and gaps in the ids are allowed. A bool mask, or ids that are all
``1``, has one document per non-empty row. Example, ``batch=2, sequence=6``::

    document_ids = [[1, 1, 2, 2, 2, 0],      # documents of 2 and 3 tokens
                      [1, 1, 1, 1, 0, 0]]      # one document of 4 tokens
    flat token stream:   positions 0 1 2 3 4 | 6 7 8 9   (9 tokens)
    cu_seqlens (flat):   [0, 2, 5, 9]
    cu_seqlens (batch):  [[0, 2, 5], [0, 4, -1]]

Every output shape follows from input shapes and static arguments, nothing
syncs with the host, and a compiled graph never specializes on the mask's
contents. NeMo AutoModel's functions, reproduced exactly on top of these
(data-sized outputs), live in :mod:`packfn.nemo_automodel`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from packfn._checks import check_integer_tensor, check_mask, check_positive_int, check_same_device
from packfn._ops import metadata as _ops
from packfn._ops._registry import assert_rules

__all__ = [
    "BatchMetadata",
    "VarlenMetadata",
    "batch_metadata",
    "check_metadata_shapes",
    "flatten_metadata",
    "varlen_metadata",
]


class VarlenMetadata(NamedTuple):
    """Flat varlen metadata with fixed capacity ``D`` documents per row.

    Attributes:
        indices: int64 ``[batch * sequence]``: positions in the flattened
            mask, valid tokens first (in order), then padding (in order). A
            permutation: ``x.flatten(0, 1)[indices]`` unpads, its inverse pads.
        cu_seqlens: int32 ``[batch * D + 1]``: document boundaries over the
            valid tokens, starting at 0, then ``num_tokens`` repeated (empty
            trailing documents).
        seqlens: int32 ``[batch * D]``: document lengths, then zeros.
        max_seqlen: int32 0-d: the longest document (0 without documents).
        num_tokens: int64 0-d: valid tokens.
        num_documents: int64 0-d: documents.
        max_seqlen_bound: Python int ``sequence``: a static upper bound of
            ``max_seqlen`` for kernels that take an int.
    """

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    seqlens: torch.Tensor
    max_seqlen: torch.Tensor
    num_tokens: torch.Tensor
    num_documents: torch.Tensor
    max_seqlen_bound: int


class BatchMetadata(NamedTuple):
    """Batch-major varlen metadata with fixed capacity ``D`` documents per row.

    Attributes:
        packed_token_indices: int64 ``[batch, sequence]``: the column of each
            valid token, -1 at padding.
        cu_seqlens: int32 ``[batch, D + 1]``: row-local boundaries starting at
            0, -1 after each row's last boundary (``[0, -1, ...]`` for an
            all-padding row).
        max_seqlen: int32 0-d: the longest document.
        num_documents: int64 ``[batch]``: documents per row.
        max_seqlen_bound: Python int ``sequence``.
    """

    packed_token_indices: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: torch.Tensor
    num_documents: torch.Tensor
    max_seqlen_bound: int


def _capacity(document_ids: torch.Tensor, max_documents: int | None) -> int:
    if max_documents is None:
        return document_ids.shape[1]
    return check_positive_int(max_documents, "max_documents")


def varlen_metadata(document_ids: torch.Tensor, *, max_documents: int | None = None) -> VarlenMetadata:
    """Build flat varlen metadata of fixed capacity, with no host sync.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids
            (the packing format above).
        max_documents: ``D``, the most documents any row holds. The default,
            ``sequence``, is always safe but makes varlen kernels visit
            ``batch * sequence`` mostly empty documents: pass your packer's
            real cap.

    Returns:
        :class:`VarlenMetadata`. For the example mask (``batch=2``,
        ``sequence=6``, ``D=2``): ``cu_seqlens = [0, 2, 5, 9, 9]``,
        ``seqlens = [2, 3, 4, 0]``, ``indices = [0, 1, 2, 3, 4, 6, 7, 8, 9, 5, 10, 11]``.

    Raises:
        ValueError: the mask is not a non-empty ``[batch, sequence]`` integer
            or bool tensor, or ``max_documents`` is not positive.
        RuntimeError: (asynchronously on a GPU) negative ids, ids that
            decrease along a row, or a row with more than ``D`` documents.
    """
    check_mask(document_ids)
    capacity = _capacity(document_ids, max_documents)
    *outputs, broken = _ops.varlen_metadata_op(document_ids, capacity)
    assert_rules(broken, _ops.mask_rules(capacity))
    return VarlenMetadata(*outputs, max_seqlen_bound=document_ids.shape[1])


def batch_metadata(document_ids: torch.Tensor, *, max_documents: int | None = None) -> BatchMetadata:
    """Build batch-major varlen metadata of fixed capacity, with no host sync.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        max_documents: ``D``, the most documents any row holds (default
            ``sequence``).

    Returns:
        :class:`BatchMetadata`. For the example mask with ``D=2``:
        ``cu_seqlens = [[0, 2, 5], [0, 4, -1]]``.

    Raises:
        ValueError: as :func:`varlen_metadata`.
        RuntimeError: as :func:`varlen_metadata`.
    """
    check_mask(document_ids)
    capacity = _capacity(document_ids, max_documents)
    parsed = _ops.batch_metadata_op(document_ids, capacity)
    assert_rules(parsed.broken, _ops.mask_rules(capacity))
    return BatchMetadata(
        parsed.packed_token_indices,
        parsed.cu_seqlens,
        parsed.row_max_seqlen.max(),
        parsed.num_documents,
        max_seqlen_bound=document_ids.shape[1],
    )


def check_metadata_shapes(
    packed_token_indices: torch.Tensor, cu_seqlens: torch.Tensor, batch_size: int, sequence_length: int
) -> None:
    """Raise ``ValueError`` unless the two tensors form ``[batch, sequence]`` batch-major metadata.

    The messages are NeMo AutoModel's (its flatten_packed_sequence_metadata
    raises them), which the drop-in shares.
    """
    if tuple(packed_token_indices.shape) != (batch_size, sequence_length) or cu_seqlens.ndim != 2:
        raise ValueError(
            "Packed sequence metadata does not match the current [batch, sequence] layout: "
            f"indices={tuple(packed_token_indices.shape)}, cu_seqlens={tuple(cu_seqlens.shape)}, "
            f"batch={batch_size}, sequence={sequence_length}."
        )
    if cu_seqlens.shape[0] != batch_size or cu_seqlens.shape[1] == 0:
        raise ValueError(
            "Packed sequence cumulative lengths must have the same batch dimension as token indices "
            "and at least one boundary per row: "
            f"indices={tuple(packed_token_indices.shape)}, cu_seqlens={tuple(cu_seqlens.shape)}."
        )


def flatten_metadata(packed_token_indices: torch.Tensor, cu_seqlens: torch.Tensor) -> VarlenMetadata:
    """Turn batch-major metadata into flat metadata of fixed capacity, with no host sync.

    This is the model-entry step after a batch was split into microbatches.

    Args:
        packed_token_indices: ``[batch, sequence]`` integer row-local token
            columns, negative at padding.
        cu_seqlens: ``[batch, D + 1]`` integer row-local boundaries, -1 after
            each row's last boundary.

    Returns:
        :class:`VarlenMetadata` with ``cu_seqlens`` ``[batch * D + 1]`` in
        the dtype of ``cu_seqlens`` (int32 for a narrower one, which could
        not hold boundaries that add up over the rows) and ``indices``
        holding the flattened index values of the valid tokens first, then
        the padding positions.

    Raises:
        ValueError: shapes or dtypes that do not form batch-major metadata.
        RuntimeError: (asynchronously on a GPU) rows that do not start at
            zero, are not monotonic, hold a boundary after -1, or whose last
            boundary differs from their count of valid tokens.
    """
    check_integer_tensor(packed_token_indices, "packed_token_indices")
    check_integer_tensor(cu_seqlens, "cu_seqlens")
    if packed_token_indices.ndim != 2 or packed_token_indices.numel() == 0:
        raise ValueError(
            f"packed_token_indices must have non-empty shape [batch, sequence], got {tuple(packed_token_indices.shape)}"
        )
    batch, sequence = packed_token_indices.shape
    check_metadata_shapes(packed_token_indices, cu_seqlens, batch, sequence)
    check_same_device(cu_seqlens, "cu_seqlens", packed_token_indices, "packed_token_indices")
    if cu_seqlens.shape[1] < 2:
        raise ValueError(
            f"cu_seqlens must have shape [batch, D + 1] with at least one document slot (D >= 1), "
            f"got {tuple(cu_seqlens.shape)}"
        )
    if torch.iinfo(cu_seqlens.dtype).bits < 32:
        cu_seqlens = cu_seqlens.to(torch.int32)
    flat = _ops.flatten_metadata_op(packed_token_indices, cu_seqlens)
    assert_rules(flat.broken, _ops.FLATTEN_RULES)
    seqlens = flat.cu_seqlens[1:] - flat.cu_seqlens[:-1]
    return VarlenMetadata(
        flat.indices, flat.cu_seqlens, seqlens, seqlens.max(), flat.num_tokens, flat.num_documents, sequence
    )
