"""Attention backends: what each needs from a document-id mask, in one table, and the inputs of one.

The packing format is described once, in :mod:`packfn.metadata`. An
attention backend is a name in :data:`ATTENTION_BACKENDS`, mapped to the
:data:`AttentionInputKind` it consumes. :func:`attention_inputs` builds those
inputs for a backend, and :func:`packfn.integrations.hf.hf_model_inputs`
looks transformers' ``attn_implementation`` up in the same table, so a new
backend is one entry here::

    packfn.ATTENTION_BACKENDS["my_varlen_kernel"] = "flash_varlen"

The kinds, for the example mask ``[[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]``:

- ``"block_causal"``: ``attention_mask``, bool ``[batch, 1, sequence, sequence]``
  (:func:`packfn.block_causal_mask`): query 3 attends keys 2 and 3.
- ``"additive_mask"``: ``attention_mask``, the same mask added to the scores
  (eager attention): 0 where a key is visible, the dtype's minimum elsewhere.
- ``"block_mask"``: ``attention_mask``, a FlexAttention ``BlockMask``
  (:func:`packfn.document_block_mask`).
- ``"flash_varlen"``: ``cu_seq_lens_q`` / ``cu_seq_lens_k``, the physical
  boundaries over the flattened ``[batch * sequence]`` stream
  (:func:`packfn.physical_varlen_metadata`: ``[0, 2, 5, 6, 10, 12, 12, ...]``),
  and ``max_length_q`` / ``max_length_k``, the bound ``sequence``.
- ``"document_ids"``: ``attention_mask``, the ids themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal, get_args

import torch

from packfn._checks import check_mask, check_positive_int, check_same_device
from packfn._ops import varlen as _varlen_ops
from packfn.masks import additive_mask, block_causal_mask, checked_block_mask
from packfn.varlen import flash_kwargs

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_INPUT_KINDS",
    "AttentionInputKind",
    "attention_backend",
    "attention_inputs",
    "passthrough_inputs",
]

AttentionInputKind = Literal["block_causal", "additive_mask", "block_mask", "flash_varlen", "document_ids"]
"""What an attention backend needs from a document-id mask (the module docstring lists each)."""

ATTENTION_INPUT_KINDS: Final = get_args(AttentionInputKind)
"""The values of :data:`AttentionInputKind`."""

ATTENTION_BACKENDS: dict[str, AttentionInputKind] = {
    # Each kind is the name of a backend that takes it.
    **{kind: kind for kind in ATTENTION_INPUT_KINDS},
    # transformers' attn_implementation names.
    "sdpa": "block_causal",
    "eager": "additive_mask",
    "flex_attention": "block_mask",
    "flash_attention_2": "flash_varlen",
    "flash_attention_3": "flash_varlen",
    "flash_attention_4": "flash_varlen",
}
"""The one registry of attention backends: a backend's name to the :data:`AttentionInputKind` it consumes.

:func:`attention_inputs` and :func:`packfn.integrations.hf.hf_model_inputs`
both dispatch on it; add an entry for a new backend.
"""


def attention_backend(backend: object, name: str = "backend") -> AttentionInputKind:
    """The :data:`AttentionInputKind` of a registered backend; ``TypeError`` / ``ValueError`` naming ``name`` else."""
    if not isinstance(backend, str):
        raise TypeError(
            f"{name} must be the name of an attention backend (a str in packfn.ATTENTION_BACKENDS), "
            f"got {type(backend).__name__}"
        )
    kind = ATTENTION_BACKENDS.get(backend)
    if kind is None:
        raise ValueError(
            f"{name} must be a registered attention backend ({', '.join(map(repr, ATTENTION_BACKENDS))}), "
            f"got {backend!r}: add an entry to packfn.ATTENTION_BACKENDS for another"
        )
    if kind not in ATTENTION_INPUT_KINDS:
        raise ValueError(
            f"packfn.ATTENTION_BACKENDS[{backend!r}] must be one of {', '.join(map(repr, ATTENTION_INPUT_KINDS))}, "
            f"got {kind!r}"
        )
    return kind


def passthrough_inputs(document_ids: torch.Tensor, **tensors: torch.Tensor | None) -> dict[str, Any]:
    """The given ``[batch, sequence]`` tensors, in order (None left out), for a dict of model inputs."""
    result: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.shape != document_ids.shape:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must have the shape of document_ids {tuple(document_ids.shape)}, got {shape}")
        check_same_device(tensor, name, document_ids, "document_ids")
        result[name] = tensor
    return result


def attention_inputs(
    document_ids: torch.Tensor,
    backend: str = "block_causal",
    *,
    block_size: int = 128,
    dtype: torch.dtype | None = None,
    build_mask: Callable[[AttentionInputKind], Any] | None = None,
) -> dict[str, Any]:
    """Return the attention inputs ``backend`` consumes, with static shapes and no host sync.

    By the backend's :data:`AttentionInputKind` (its entry in
    :data:`ATTENTION_BACKENDS`): ``attention_mask`` (the block-causal mask,
    additive or not, the ``BlockMask``, or the ids), or the four flash
    varlen keys. Every shape is a function of ``[batch, sequence]``.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        backend: A name in :data:`ATTENTION_BACKENDS`.
        block_size: The ``BlockMask``'s block size (``"block_mask"``).
        dtype: The floating dtype of an ``"additive_mask"`` (default: the
            default dtype).
        build_mask: Builds ``attention_mask`` for the three mask kinds instead
            of the plain document mask (a mask per layer, with windows: what
            :func:`packfn.integrations.hf.hf_model_inputs` passes); called
            with the kind. It checks the mask's rules itself, if at all.

    Returns:
        A dict: a model's ``**kwargs``.

    Raises:
        TypeError / ValueError: a malformed mask, an unregistered backend, a
            non-positive ``block_size``, a ``dtype`` that is not floating of
            16 bits or more, a ``build_mask`` that is not callable.
        RuntimeError: (a sync-free assert) negative or decreasing ids, for the
            masks (any ids are valid segments for ``"flash_varlen"``, and
            ``"document_ids"`` passes them on as they are).
    """
    check_mask(document_ids)
    kind = attention_backend(backend)
    block_size = check_positive_int(block_size, "block_size")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"dtype must be a floating torch.dtype of 16 bits or more (the additive mask's), got {dtype!r}")
    if build_mask is not None and not callable(build_mask):
        raise TypeError(f"build_mask must be callable or None, got {type(build_mask).__name__}")
    if kind == "flash_varlen":
        cu_seqlens = _varlen_ops.physical_varlen_metadata_op(document_ids).cu_seqlens
        return flash_kwargs(cu_seqlens, document_ids.shape[1])
    if kind == "document_ids":
        return {"attention_mask": document_ids}
    if build_mask is not None:
        return {"attention_mask": build_mask(kind)}
    if kind == "block_mask":
        return {"attention_mask": checked_block_mask(document_ids, block_size, None, True, None, check=True)}
    mask = block_causal_mask(document_ids)
    return {"attention_mask": additive_mask(mask, dtype) if kind == "additive_mask" else mask}
