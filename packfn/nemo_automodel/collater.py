"""NeMo AutoModel's ``neat_packed_collater`` (``datasets.utils`` 0.7.0): its packed keys, exactly or with static shapes.

The contract's mask type is looked up in packfn's registry of attention
backends (:func:`packfn.attention_inputs`); this module maps what the core
builds onto the collater's keys (``_packed_seq_ids`` and the metadata keys
are NeMo AutoModel's).
"""

from __future__ import annotations

from typing import Any, get_args

import torch

from packfn._checks import check_mask
from packfn._ops import masks as _mask_ops
from packfn._ops import varlen as _varlen_ops
from packfn._ops.metadata import mask_rules
from packfn.attention import attention_inputs, passthrough_inputs
from packfn.metadata import batch_metadata
from packfn.nemo_automodel._trim import checked_ints
from packfn.nemo_automodel.contract import DEFAULT_PACKED_SEQUENCE_CONTRACT, PackedMaskType, PackedSequenceContract
from packfn.nemo_automodel.metadata import build_packed_sequence_metadata
from packfn.varlen import flash_kwargs

__all__ = ["packed_attention_inputs"]

_MASK_TYPES = get_args(PackedMaskType)


def _contract(contract: object) -> tuple[str, bool]:
    """``contract``'s mask type and metadata flag, refusing what is not a contract or names no known mask type."""
    if not all(hasattr(contract, name) for name in ("packed_mask_type", "requires_packed_sequence_metadata")):
        raise TypeError(
            "contract must be a PackedSequenceContract (with packed_mask_type and "
            f"requires_packed_sequence_metadata), got {type(contract).__name__} {contract!r}"
        )
    mask_type = contract.packed_mask_type
    if mask_type not in _MASK_TYPES:
        raise ValueError(f"Unsupported packed_mask_type: {mask_type!r}")  # the collater's message
    return mask_type, bool(contract.requires_packed_sequence_metadata)


def packed_attention_inputs(
    document_ids: torch.Tensor,
    contract: PackedSequenceContract = DEFAULT_PACKED_SEQUENCE_CONTRACT,
    *,
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    static: bool = False,
    max_documents: int | None = None,
) -> dict[str, Any]:
    """Return the packed keys ``neat_packed_collater`` builds for ``contract``: its exact values, or static shapes.

    Keys, in the collater's order: ``input_ids``, ``labels`` and
    ``position_ids`` when given; by ``contract.packed_mask_type``
    ``attention_mask`` (``"block_causal"``: the bool block-causal mask;
    ``"document_ids"``: ``document_ids``) or, for ``"flash_varlen"``,
    ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``;
    with ``contract.requires_packed_sequence_metadata``
    ``packed_token_indices``, ``cu_seqlens`` and ``max_seqlen``; then
    ``_packed_seq_ids`` (``document_ids``).

    Exact (the default): the collater's values, sized by the data:
    ``cu_seq_lens_*`` end at the last segment and ``max_length_*`` is the
    longest one, the metadata is :func:`build_packed_sequence_metadata`'s,
    and ``_packed_seq_ids`` is present only when an id exceeds 1 or metadata
    is required. One host read in eager (plus the metadata's); unbacked
    sizes under ``torch.compile``, where a contract without metadata cannot
    be traced (whether ``_packed_seq_ids`` is present depends on the data).

    ``static=True``: every shape a function of ``[batch, sequence]``, no host
    read, for compiled forwards and CUDA graphs: the inputs of
    :func:`packfn.attention_inputs` for the mask type (the physical
    boundaries padded to ``batch * sequence + 1`` entries, ``max_length_*``
    the bound ``sequence``), the metadata of :func:`packfn.batch_metadata`
    (``cu_seqlens`` ``[batch, D + 1]``, ``D = max_documents or sequence``;
    ``max_seqlen`` the bound ``sequence``), and ``_packed_seq_ids`` always.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        contract: What the model consumes (a :class:`PackedSequenceContract`).
        input_ids, labels, position_ids: Optional ``[batch, sequence]`` tensors to pass through.
        static: Static shapes and no host read instead of the collater's exact values.
        max_documents: ``D`` for the static metadata (default ``sequence``); static only.

    Returns:
        A dict: a model's ``**kwargs``, in the collater's key order.

    Raises:
        TypeError: ``contract`` is not a contract (a mask type string, say),
            or ``static`` is not a bool.
        ValueError: a mask that is not a non-empty ``[batch, sequence]``
            integer or bool tensor, pass-through tensors not shaped like it,
            a mask type the collater does not know (its message),
            ``max_documents`` without ``static=True``; exact: negative or
            decreasing ids (checked where the collater's block-causal mask and
            metadata check them), and under ``torch.compile`` a contract
            without metadata.
        RuntimeError: static: (a sync-free assert) negative or decreasing ids,
            for the block-causal mask and the metadata.
    """
    check_mask(document_ids)
    mask_type, needs_metadata = _contract(contract)
    if not isinstance(static, bool):
        raise TypeError(f"static must be a bool, got {type(static).__name__}")
    if max_documents is not None and not static:
        raise ValueError("max_documents sizes the static metadata: pass it with static=True")
    if not static and not needs_metadata and torch.compiler.is_compiling():
        raise ValueError(
            "packfn.nemo_automodel.packed_attention_inputs decides from the data whether to add _packed_seq_ids "
            "(for contracts that require no packed metadata), which cannot be traced: use "
            "packed_attention_inputs(..., static=True) under torch.compile / torch.export"
        )
    result = passthrough_inputs(document_ids, input_ids=input_ids, labels=labels, position_ids=position_ids)
    if static:
        result.update(attention_inputs(document_ids, mask_type))
        if needs_metadata:
            metadata = batch_metadata(document_ids, max_documents=max_documents)
            result["packed_token_indices"] = metadata.packed_token_indices
            result["cu_seqlens"] = metadata.cu_seqlens
            result["max_seqlen"] = metadata.max_seqlen_bound
        result["_packed_seq_ids"] = document_ids
        return result
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
