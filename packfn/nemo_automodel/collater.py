"""NeMo AutoModel's ``neat_packed_collater`` (``datasets.utils`` 0.7.0): its packed keys, exactly.

The static form, whose every shape is a function of ``[batch, sequence]``,
is :func:`packfn.packed_attention_inputs`.
"""

from __future__ import annotations

from typing import Any

import torch

from packfn._checks import check_mask
from packfn._ops import masks as _mask_ops
from packfn._ops import varlen as _varlen_ops
from packfn._ops.metadata import mask_rules
from packfn.contract import (
    DEFAULT_PACKED_SEQUENCE_CONTRACT,
    PackedSequenceContract,
    check_mask_type,
    passthrough_inputs,
)
from packfn.nemo_automodel._trim import checked_ints
from packfn.nemo_automodel.metadata import build_packed_sequence_metadata
from packfn.varlen import flash_kwargs

__all__ = ["packed_attention_inputs"]


def packed_attention_inputs(
    document_ids: torch.Tensor,
    contract: PackedSequenceContract = DEFAULT_PACKED_SEQUENCE_CONTRACT,
    *,
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Return the packed keys ``neat_packed_collater`` builds for ``contract``, with its exact values.

    Keys as :func:`packfn.packed_attention_inputs`, in the same order, but
    sized by the data: ``cu_seq_lens_*`` end at the last segment and
    ``max_length_*`` is the longest one; the metadata is
    :func:`build_packed_sequence_metadata`'s; ``_packed_seq_ids`` is present
    only when an id exceeds 1 or metadata is required. One host read in
    eager (plus the metadata's); unbacked sizes under ``torch.compile``,
    where a contract without metadata cannot be traced (whether the key
    ``_packed_seq_ids`` is present depends on the data).

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        contract: What the model consumes.
        input_ids, labels, position_ids: Optional ``[batch, sequence]`` tensors to pass through.

    Returns:
        A dict: a model's ``**kwargs``, in the collater's key order.

    Raises:
        ValueError: as :func:`packfn.packed_attention_inputs`, and negative or
            decreasing ids (checked where the collater's block-causal mask
            and metadata check them); under ``torch.compile`` a contract
            without metadata.
    """
    check_mask(document_ids)
    mask_type = check_mask_type(contract)
    needs_metadata = contract.requires_packed_sequence_metadata
    if not needs_metadata and torch.compiler.is_compiling():
        raise ValueError(
            "packfn.nemo_automodel.packed_attention_inputs decides from the data whether to add _packed_seq_ids "
            "(for contracts that require no packed metadata), which cannot be traced: use "
            "packfn.packed_attention_inputs under torch.compile / torch.export"
        )
    result = passthrough_inputs(document_ids, input_ids=input_ids, labels=labels, position_ids=position_ids)
    broken = None
    if mask_type == "block_causal":
        result["attention_mask"], broken = _mask_ops.block_causal_mask_op(document_ids, True)
    elif mask_type == "document_ids":
        result["attention_mask"] = document_ids
    return _collater_inputs(result, document_ids, mask_type, needs_metadata, broken)


def _collater_inputs(
    result: dict[str, Any],
    document_ids: torch.Tensor,
    mask_type: str,
    needs_metadata: bool,
    broken: torch.Tensor | None,
) -> dict[str, Any]:
    """The collater's exact values and keys past the attention mask.

    One host read in eager for the rule flags, the segment sizes and whether
    an id exceeds 1 (plus the one of :func:`build_packed_sequence_metadata`
    where metadata is required); unbacked sizes under torch.compile.
    """
    batch, sequence = document_ids.shape
    reads: list[torch.Tensor] = []
    bounds: list[int] = []
    varlen = None
    if mask_type == "flash_varlen":
        varlen = _varlen_ops.physical_varlen_metadata_op(document_ids)
        reads += [varlen.num_segments, varlen.max_seqlen]
        bounds += [batch * sequence, sequence]
    if not needs_metadata:
        reads.append((document_ids.max() > 1).to(torch.int64))
        bounds.append(1)
    # Only the block-causal mask checks the ids, as the collater's does.
    flags = broken if broken is not None else torch.zeros(3, dtype=torch.bool, device=document_ids.device)
    ints = checked_ints(reads, bounds, flags, mask_rules(sequence))
    if varlen is not None:
        segments, longest = ints[:2]
        result.update(flash_kwargs(varlen.cu_seqlens[: segments + 1], longest))
    if needs_metadata:
        result.update(build_packed_sequence_metadata(document_ids))
    if needs_metadata or ints[-1]:
        result["_packed_seq_ids"] = document_ids
    return result
