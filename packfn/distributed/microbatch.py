"""Microbatch splits of batch-major metadata, with no host sync.

Batch-major metadata (:func:`packfn.batch_metadata`) is row-local, so a
slice of its rows is a microbatch's metadata, except the batch-wide
``max_seqlen``; :func:`split_batch_metadata` recomputes it per microbatch.
"""

from __future__ import annotations

import torch

from packfn._checks import check_positive_int
from packfn.metadata import BatchMetadata

__all__ = ["split_batch_metadata"]


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
