"""NeMo AutoModel's ``datasets.packed_seq`` 0.7.0: ``PackedSeqParams`` from document ids, exactly.

The static form, with fixed-size boundaries and no host read, is
:func:`packfn.physical_varlen_metadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from packfn._ops import varlen as _ops
from packfn.nemo_automodel._trim import python_ints
from packfn.varlen import flash_kwargs, physical_ids

__all__ = ["PackedSeqParams", "packed_seq_params_from_doc_ids", "to_flash_attention_kwargs"]


@dataclass
class PackedSeqParams:
    """Packed-sequence metadata for the varlen flash-attention path (drop-in for NeMo AutoModel's).

    Attributes:
        cu_seqlens: int32 ``[num_segments + 1]``: physical boundaries over
            ``[batch * sequence]``, ending at ``batch * sequence``.
        max_seqlen: the longest segment.
        doc_ids: the ``[batch, sequence]`` document ids, unchanged.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    doc_ids: torch.Tensor


def packed_seq_params_from_doc_ids(doc_ids: torch.Tensor) -> PackedSeqParams:
    """Build :class:`PackedSeqParams` from a document-id mask (drop-in).

    The static op followed by one trim to the segment count: a host sync in
    eager, an unbacked size under torch.compile / torch.export.

    Args:
        doc_ids: ``[batch, sequence]`` integer or bool document ids.

    Returns:
        :class:`PackedSeqParams` with ``cu_seqlens`` int32 ``[segments + 1]``
        and ``max_seqlen`` a Python int. For the example mask:
        ``([0, 2, 5, 6, 10, 12], 4, doc_ids)``.

    Raises:
        ValueError: ``doc_ids`` is not 2-D (upstream's message), or is empty
            or floating. Any ids are valid, negative or decreasing ones
            included (as upstream's): segments are runs of equal ids.
    """
    if isinstance(doc_ids, torch.Tensor) and doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be 2D [batch, sequence], got shape {tuple(doc_ids.shape)}")
    ids = physical_ids(doc_ids, "doc_ids")
    if not torch.compiler.is_compiling():
        # Eager: the starts in one pass, then their positions at the exact
        # segment count (nonzero's read of the count) and the longest
        # segment: upstream's two host reads, with none of its other passes.
        starts = _ops.segment_starts(ids).reshape(-1).nonzero().squeeze(1)
        cu_seqlens = torch.cat([starts, starts.new_tensor([ids.numel()])]).to(torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # a non-empty mask has a segment
        return PackedSeqParams(cu_seqlens=cu_seqlens, max_seqlen=longest, doc_ids=doc_ids)
    return trimmed_params(doc_ids, _ops.physical_varlen_metadata_op(ids))


def trimmed_params(doc_ids: torch.Tensor, varlen: _ops.PhysicalVarlenOutputs) -> PackedSeqParams:
    """The op's static boundaries trimmed to the segment count (one host read in eager, unbacked when traced)."""
    batch, sequence = doc_ids.shape
    segments, longest = python_ints([varlen.num_segments, varlen.max_seqlen], [batch * sequence, sequence])
    return PackedSeqParams(varlen.cu_seqlens[: segments + 1], max_seqlen=longest, doc_ids=doc_ids)


def to_flash_attention_kwargs(params: PackedSeqParams) -> dict[str, torch.Tensor | int]:
    """Return HF ``FlashAttentionKwargs`` (drop-in): ``cu_seq_lens_q/k`` and ``max_length_q/k``.

    Query and key share one layout (self-attention), so the ``q`` and ``k``
    entries are the same objects.
    """
    return flash_kwargs(params.cu_seqlens, params.max_seqlen)
