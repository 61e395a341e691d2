"""Packing contracts (which packed attention mask a model consumes) and the attention inputs of each.

The contract types are NeMo AutoModel's (``datasets.packing`` 0.7.0: the
same names, defaults and frozen dataclass); :func:`packed_attention_inputs`
returns, for a contract, exactly the tensors it asks for, keyed as NeMo
AutoModel's ``neat_packed_collater`` keys them, with static shapes. The
collater's exact, data-sized form is
:func:`packfn.nemo_automodel.packed_attention_inputs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import torch

from packfn._checks import check_mask
from packfn._ops import masks as _mask_ops
from packfn._ops import varlen as _varlen_ops
from packfn._ops._registry import assert_rules
from packfn._ops.metadata import mask_rules
from packfn.metadata import batch_metadata
from packfn.varlen import flash_kwargs

__all__ = [
    "DEFAULT_PACKED_SEQUENCE_CONTRACT",
    "FLASH_ATTENTION_IMPLEMENTATIONS",
    "MASK_TYPES",
    "PackedMaskType",
    "PackedSequenceContract",
    "check_mask_type",
    "packed_attention_inputs",
    "passthrough_inputs",
]

PackedMaskType = Literal["block_causal", "document_ids", "flash_varlen"]
"""The packed attention-mask representation a model consumes.

- ``"block_causal"``: a ``[batch, 1, sequence, sequence]`` bool mask.
- ``"document_ids"``: the document-id mask itself.
- ``"flash_varlen"``: physical varlen boundaries for flash attention.
"""


class PackedSequenceContract(Protocol):
    """What a model needs from the collater of packed batches."""

    @property
    def packed_mask_type(self) -> PackedMaskType:
        """The packed attention-mask representation the model consumes."""
        ...

    @property
    def requires_packed_sequence_metadata(self) -> bool:
        """Whether the model consumes token indices and cumulative lengths."""
        ...


@dataclass(frozen=True)
class _DefaultPackedSequenceContract:
    """The contract used when the model states none: block-causal masks, no metadata."""

    packed_mask_type: PackedMaskType = "block_causal"
    requires_packed_sequence_metadata: bool = False


DEFAULT_PACKED_SEQUENCE_CONTRACT: Final[PackedSequenceContract] = _DefaultPackedSequenceContract()

MASK_TYPES: Final = ("block_causal", "document_ids", "flash_varlen")
"""The values of :data:`PackedMaskType`."""

FLASH_ATTENTION_IMPLEMENTATIONS: Final = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
"""transformers' ``attn_implementation`` names of flash attention (the varlen path)."""


def check_mask_type(contract: PackedSequenceContract) -> str:
    """``contract.packed_mask_type`` if it is one of :data:`MASK_TYPES`, else ``ValueError``."""
    mask_type = contract.packed_mask_type
    if mask_type not in MASK_TYPES:
        raise ValueError(f"Unsupported packed_mask_type: {mask_type!r}")
    return mask_type


def passthrough_inputs(document_ids: torch.Tensor, **tensors: torch.Tensor | None) -> dict[str, Any]:
    """The given ``[batch, sequence]`` tensors, in order (None left out), for a dict of model inputs."""
    result: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.shape != document_ids.shape:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must have the shape of document_ids {tuple(document_ids.shape)}, got {shape}")
        result[name] = tensor
    return result


def packed_attention_inputs(
    document_ids: torch.Tensor,
    contract: PackedSequenceContract = DEFAULT_PACKED_SEQUENCE_CONTRACT,
    *,
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    max_documents: int | None = None,
) -> dict[str, Any]:
    """Return the attention inputs ``contract`` asks for, with static shapes and no host sync.

    Keyed as NeMo AutoModel's ``neat_packed_collater`` keys them, in its
    order. By ``contract.packed_mask_type``:

    - ``"block_causal"``: ``attention_mask``, :func:`packfn.block_causal_mask`.
    - ``"document_ids"``: ``attention_mask``, ``document_ids`` itself.
    - ``"flash_varlen"``: no ``attention_mask``; ``cu_seq_lens_q`` and
      ``cu_seq_lens_k`` (one int32 ``[batch * sequence + 1]`` tensor, the
      physical boundaries of :func:`packfn.physical_varlen_metadata`) and
      ``max_length_q`` / ``max_length_k``, the bound ``sequence`` (varlen
      kernels accept an upper bound).

    With ``contract.requires_packed_sequence_metadata`` also
    ``packed_token_indices`` int64 ``[batch, sequence]``, ``cu_seqlens`` int32
    ``[batch, D + 1]`` (:func:`packfn.batch_metadata`, ``D = max_documents or
    sequence``) and ``max_seqlen``, the bound ``sequence``. Then
    ``_packed_seq_ids``: ``document_ids``, always. ``input_ids``, ``labels``
    and ``position_ids`` are passed through first when given.

    Every shape is a function of ``[batch, sequence]``; for the collater's
    exact, data-sized values use :func:`packfn.nemo_automodel.packed_attention_inputs`.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        contract: What the model consumes (:class:`PackedSequenceContract`).
        input_ids, labels, position_ids: Optional ``[batch, sequence]`` tensors to pass through.
        max_documents: ``D`` for the metadata (default ``sequence``).

    Returns:
        A dict: a model's ``**kwargs``.

    Raises:
        ValueError: a mask that is not a non-empty ``[batch, sequence]``
            integer or bool tensor, pass-through tensors not shaped
            ``[batch, sequence]``, or an unknown ``packed_mask_type``.
        RuntimeError: (a sync-free assert) negative or decreasing ids, for
            the block-causal mask and the metadata.
    """
    check_mask(document_ids)
    mask_type = check_mask_type(contract)
    result = passthrough_inputs(document_ids, input_ids=input_ids, labels=labels, position_ids=position_ids)
    if mask_type == "block_causal":
        result["attention_mask"], broken = _mask_ops.block_causal_mask_op(document_ids, True)
        assert_rules(broken, mask_rules(document_ids.shape[1]))
    elif mask_type == "document_ids":
        result["attention_mask"] = document_ids
    else:
        cu_seqlens = _varlen_ops.physical_varlen_metadata_op(document_ids).cu_seqlens
        result.update(flash_kwargs(cu_seqlens, document_ids.shape[1]))
    if contract.requires_packed_sequence_metadata:
        metadata = batch_metadata(document_ids, max_documents=max_documents)
        result["packed_token_indices"] = metadata.packed_token_indices
        result["cu_seqlens"] = metadata.cu_seqlens
        result["max_seqlen"] = metadata.max_seqlen_bound
    result["_packed_seq_ids"] = document_ids
    return result
