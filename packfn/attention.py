"""Attention inputs for every packing contract, and unpad / pad of activations.

The packing format is described once, in :mod:`packfn._ops.metadata`; here
the mask is called ``document_ids`` (upstream's ``doc_ids``). Example,
``batch=2, sequence=6``::

    document_ids = [[1, 1, 2, 2, 2, 0],
                    [1, 1, 1, 1, 0, 0]]

A query attends the keys of its row that are not after it and carry its id;
padding attends nothing and nothing attends it. Per packed mask type
(:data:`packfn.PackedMaskType`):

- ``"block_causal"``: :func:`block_causal_mask`, bool ``[batch, 1, sequence, sequence]``.
- ``"document_ids"``: the mask itself.
- ``"flash_varlen"``: physical boundaries over the flattened
  ``[batch * sequence]`` stream, padding runs included
  (:func:`physical_varlen_metadata`, static; :func:`packed_seq_params_from_doc_ids`,
  the NeMo AutoModel drop-in). For the example: ``[0, 2, 5, 6, 10, 12]``.
- FlexAttention: :func:`document_mask_mod` and :func:`document_block_mask`.

:func:`packed_attention_inputs` returns what a :class:`packfn.PackedSequenceContract`
asks for. :func:`unpad` and :func:`pad` move activations between
``[batch, sequence, ...]`` and the varlen token order of :func:`packfn.varlen_metadata`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask

from packfn._checks import check_mask, check_positive_int
from packfn._ops import attention as _ops
from packfn._ops._registry import assert_rules, checked_ints, python_ints
from packfn.contract import DEFAULT_PACKED_SEQUENCE_CONTRACT, PackedSequenceContract
from packfn.metadata import VarlenMetadata, batch_metadata, build_packed_sequence_metadata

__all__ = [
    "PackedSeqParams",
    "PhysicalVarlenMetadata",
    "block_causal_mask",
    "document_block_mask",
    "document_mask_mod",
    "packed_attention_inputs",
    "packed_position_ids",
    "packed_seq_params_from_doc_ids",
    "pad",
    "physical_varlen_metadata",
    "to_flash_attention_kwargs",
    "unpad",
]


# ------------------------------------------------------------- block causal


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Build the block-causal mask of a packed batch, with no host sync.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.

    Returns:
        Bool ``[batch, 1, sequence, sequence]``: True where query ``i`` may
        attend key ``j``: same id, ``j <= i``, both valid. The eager / SDPA
        mask of ``neat_packed_collater``.

    Raises:
        ValueError: the mask is not a non-empty ``[batch, sequence]`` integer
            or bool tensor.
        RuntimeError: (a sync-free assert, asynchronous on a GPU) negative or
            decreasing ids.
    """
    check_mask(document_ids, name="document_ids")
    mask, broken = _ops.block_causal_mask(document_ids)
    assert_rules(broken, _ops.document_rules(document_ids))
    return mask


# ------------------------------------------------------------- position ids


def packed_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at every document of a packed batch, with no host sync.

    A valid token's position is its rank among the valid tokens of its
    document, so every document sees the positions it would have alone
    (padding inside a document does not count). A padding token continues
    the count of the last valid token before it in its row; one with none
    before it counts from the row start. Trailing padding therefore continues
    the last document, which is what NeMo AutoModel's packed-sequence
    collater writes (``_pad_pack``); the tests hold the two equal.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.

    Returns:
        int64 ``[batch, sequence]``. For the example mask of this module:
        ``[[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]``.

    Raises:
        ValueError: as :func:`block_causal_mask`.
        RuntimeError: as :func:`block_causal_mask`.
    """
    check_mask(document_ids, name="document_ids")
    positions, broken = _ops.position_ids(document_ids)
    assert_rules(broken, _ops.document_rules(document_ids))
    return positions


# ------------------------------------------------------------ physical varlen


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
        document_ids: ``[batch, sequence]`` integer or bool document ids.

    Returns:
        :class:`PhysicalVarlenMetadata`. For the example mask:
        ``cu_seqlens = [0, 2, 5, 6, 10, 12, 12, ..., 12]`` (13 entries),
        ``max_seqlen = 4``, ``num_segments = 5``.

    Raises:
        ValueError: the mask is not a non-empty ``[batch, sequence]`` integer
            or bool tensor. Any ids are valid: segments are runs of equal
            ids, whatever their values or order (as upstream's).
    """
    check_mask(document_ids, name="document_ids")
    return PhysicalVarlenMetadata(*_ops.physical_varlen_metadata(document_ids), document_ids.shape[1])


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
    check_mask(doc_ids, name="doc_ids")
    if not torch.compiler.is_compiling():
        # Eager: the starts in one pass, then their positions at the exact
        # segment count (nonzero's read of the count) and the longest
        # segment: upstream's two host reads, with none of its other passes.
        starts = _ops.segment_starts(doc_ids).reshape(-1).nonzero().squeeze(1)
        cu_seqlens = torch.cat([starts, starts.new_tensor([doc_ids.numel()])]).to(torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # a non-empty mask has a segment
        return PackedSeqParams(cu_seqlens=cu_seqlens, max_seqlen=longest, doc_ids=doc_ids)
    return _exact_params(doc_ids, _ops.physical_varlen_metadata(doc_ids))


def _exact_params(doc_ids: torch.Tensor, varlen: _ops.PhysicalVarlenOutputs) -> PackedSeqParams:
    """The op's static boundaries trimmed to the segment count (one host read in eager)."""
    batch, sequence = doc_ids.shape
    segments, longest = python_ints([varlen.num_segments, varlen.max_seqlen], [batch * sequence, sequence])
    return PackedSeqParams(cu_seqlens=varlen.cu_seqlens[: segments + 1], max_seqlen=longest, doc_ids=doc_ids)


def to_flash_attention_kwargs(params: PackedSeqParams) -> dict[str, torch.Tensor | int]:
    """Return HF ``FlashAttentionKwargs`` (drop-in): ``cu_seq_lens_q/k`` and ``max_length_q/k``.

    Query and key share one layout (self-attention), so the ``q`` and ``k``
    entries are the same objects.
    """
    return {
        "cu_seq_lens_q": params.cu_seqlens,
        "cu_seq_lens_k": params.cu_seqlens,
        "max_length_q": params.max_seqlen,
        "max_length_k": params.max_seqlen,
    }


# ------------------------------------------------------------ flex attention


def _check_window(window: object) -> int | None:
    return None if window is None else check_positive_int(window, "window")


def _check_positions(positions: object, document_ids: torch.Tensor) -> None:
    if positions is None:
        return
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError("positions must be an integer tensor, such as packed_position_ids(document_ids)")
    if positions.shape != document_ids.shape:
        raise ValueError(
            f"positions must have the shape of document_ids {tuple(document_ids.shape)}, got {tuple(positions.shape)}"
        )


def document_mask_mod(
    document_ids: torch.Tensor, *, window: int | None = None, positions: torch.Tensor | None = None
) -> Callable[..., torch.Tensor]:
    """Return the document-causal FlexAttention ``mask_mod`` of a packed batch.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids
            (captured by the returned function, not copied).
        window: Sliding window, or None: query ``q`` then also needs
            ``q - kv < window`` (it sees at most ``window`` tokens, itself
            included, as HF's ``sliding_window``).
        positions: Measure the window in these ``[batch, sequence]``
            positions instead of columns (:func:`packed_position_ids`: padding
            inside a document then does not shrink the window).

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx) -> bool``: same id, valid, ``kv_idx <= q_idx``.

    Raises:
        ValueError / TypeError: a malformed mask, a non-positive window or
            positions not an integer tensor shaped like the mask.
    """
    check_mask(document_ids, name="document_ids")
    window = _check_window(window)
    _check_positions(positions, document_ids)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        query = document_ids[b, q_idx]
        keep = (query == document_ids[b, kv_idx]) & (query != 0) & (q_idx >= kv_idx)
        if window is not None:
            distance = q_idx - kv_idx if positions is None else positions[b, q_idx] - positions[b, kv_idx]
            keep = keep & (distance < window)
        return keep

    return mask_mod


def document_block_mask(
    document_ids: torch.Tensor,
    *,
    block_size: int = 128,
    window: int | None = None,
    separate_full_blocks: bool = True,
    positions: torch.Tensor | None = None,
) -> BlockMask:
    """Build the FlexAttention ``BlockMask`` of a packed batch from its document spans.

    Equal, tensor for tensor, to ``create_block_mask(document_mask_mod(...),
    batch, 1, sequence, sequence, BLOCK_SIZE=block_size)``, but computed from
    per-block first / last ids and positions (``O(batch * blocks**2)``)
    instead of evaluating the mask over ``sequence**2`` pairs. Static shapes,
    no host sync, no graph break: build it inside the compiled forward.
    A sequence that is not a multiple of ``block_size`` is handled as
    ``create_block_mask`` does (the last block is partial).

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        block_size: Query and key block size.
        window: Sliding window, as :func:`document_mask_mod`.
        separate_full_blocks: As ``create_block_mask``: store fully unmasked
            blocks apart so kernels skip ``mask_mod`` on them.
        positions: Measure the window in these positions, as :func:`document_mask_mod`.

    Returns:
        A ``BlockMask`` with one head (broadcast over heads), ``kv_num_blocks``
        int32 ``[batch, 1, blocks]`` and ``kv_indices`` int32
        ``[batch, 1, blocks, blocks]`` (present blocks ascending, then the
        others), the same for full blocks, and ``mask_mod`` from
        :func:`document_mask_mod`.

    Raises:
        ValueError / TypeError: as :func:`block_causal_mask`, or a
            non-positive ``block_size`` / ``window``.
        RuntimeError: as :func:`block_causal_mask`.
    """
    check_mask(document_ids, name="document_ids")
    block_size = check_positive_int(block_size, "block_size")
    window = _check_window(window)
    if not isinstance(separate_full_blocks, bool):
        raise TypeError(f"separate_full_blocks must be a bool, got {type(separate_full_blocks).__name__}")
    _check_positions(positions, document_ids)
    blocks = _ops.document_kv_blocks(document_ids, block_size, window, separate_full_blocks, positions)
    assert_rules(blocks.broken, _ops.document_rules(document_ids))
    full = (blocks.full_kv_num_blocks, blocks.full_kv_indices) if separate_full_blocks else (None, None)
    sequence = document_ids.shape[1]
    return BlockMask.from_kv_blocks(
        blocks.kv_num_blocks,
        blocks.kv_indices,
        *full,
        BLOCK_SIZE=block_size,
        mask_mod=document_mask_mod(document_ids, window=window, positions=positions),
        seq_lengths=(sequence, sequence),
    )


# ------------------------------------------------------------ per contract


def packed_attention_inputs(
    document_ids: torch.Tensor,
    contract: PackedSequenceContract = DEFAULT_PACKED_SEQUENCE_CONTRACT,
    *,
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    max_documents: int | None = None,
    static: bool = True,
) -> dict[str, Any]:
    """Return the attention inputs ``contract`` asks for, keyed as ``neat_packed_collater`` keys them.

    Keys, by ``contract.packed_mask_type``:

    - ``"block_causal"``: ``attention_mask``, :func:`block_causal_mask`.
    - ``"document_ids"``: ``attention_mask``, ``document_ids`` itself.
    - ``"flash_varlen"``: no ``attention_mask``; ``cu_seq_lens_q`` and
      ``cu_seq_lens_k`` (one int32 tensor, physical boundaries) and
      ``max_length_q`` / ``max_length_k`` (Python ints).

    With ``contract.requires_packed_sequence_metadata`` also
    ``packed_token_indices`` int64 ``[batch, sequence]``, ``cu_seqlens`` int32
    ``[batch, D + 1]`` (row-local, -1 after each row's last boundary) and
    ``max_seqlen`` (Python int). ``_packed_seq_ids`` is ``document_ids``.
    ``input_ids``, ``labels`` and ``position_ids`` are passed through when given.

    ``static=True`` (the default) keeps every shape a function of
    ``[batch, sequence]``: ``cu_seq_lens_*`` is ``[batch * sequence + 1]``
    (the total repeated past the last segment), ``cu_seqlens`` has
    ``D = max_documents or sequence`` slots, every int is the bound
    ``sequence`` (varlen kernels accept an upper bound), and
    ``_packed_seq_ids`` is always present. ``static=False`` gives exactly the
    collater's values and keys (``_packed_seq_ids`` only when an id exceeds 1
    or metadata is required), with one host sync in eager.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        contract: What the model consumes (:class:`packfn.PackedSequenceContract`).
        input_ids, labels, position_ids: Optional ``[batch, sequence]`` tensors to pass through.
        max_documents: ``D`` for the static metadata (default ``sequence``).
        static: Fixed shapes (True) or the collater's exact values (False).

    Returns:
        A dict: a model's ``**kwargs``, in the collater's key order.

    Raises:
        ValueError: a mask that is not a non-empty ``[batch, sequence]``
            integer or bool tensor, pass-through tensors not shaped
            ``[batch, sequence]``, an unknown ``packed_mask_type``; with
            ``static=False`` also negative or decreasing ids.
        RuntimeError: (``static=True``, a sync-free assert) negative or
            decreasing ids.
    """
    check_mask(document_ids, name="document_ids")
    mask_type = contract.packed_mask_type
    if mask_type not in ("block_causal", "document_ids", "flash_varlen"):
        raise ValueError(f"Unsupported packed_mask_type: {mask_type!r}")
    needs_metadata = contract.requires_packed_sequence_metadata
    if not static and not needs_metadata and torch.compiler.is_compiling():
        # The collater adds _packed_seq_ids only when an id exceeds 1: a key
        # set that depends on the data cannot be traced into one graph.
        raise ValueError(
            "packed_attention_inputs(static=False) decides from the data whether to add _packed_seq_ids "
            "(for contracts that require no packed metadata), which cannot be traced: use static=True "
            "under torch.compile / torch.export"
        )
    result = _passthrough(document_ids, input_ids=input_ids, labels=labels, position_ids=position_ids)
    broken = None
    if mask_type == "block_causal":
        result["attention_mask"], broken = _ops.block_causal_mask(document_ids)
    elif mask_type == "document_ids":
        result["attention_mask"] = document_ids
    if static:
        if broken is not None:
            assert_rules(broken, _ops.document_rules(document_ids))
        if mask_type == "flash_varlen":
            cu_seqlens = _ops.physical_varlen_metadata(document_ids).cu_seqlens
            result.update(to_flash_attention_kwargs(PackedSeqParams(cu_seqlens, document_ids.shape[1], document_ids)))
        if needs_metadata:
            metadata = batch_metadata(document_ids, max_documents=max_documents)
            result["packed_token_indices"] = metadata.packed_token_indices
            result["cu_seqlens"] = metadata.cu_seqlens
            result["max_seqlen"] = metadata.max_seqlen_bound
        result["_packed_seq_ids"] = document_ids
        return result
    return _collater_inputs(result, document_ids, mask_type, needs_metadata, broken)


def _collater_inputs(
    result: dict[str, Any],
    document_ids: torch.Tensor,
    mask_type: str,
    needs_metadata: bool,
    broken: torch.Tensor | None,
) -> dict[str, Any]:
    """``packed_attention_inputs(static=False)``: the collater's exact values and keys.

    One host read in eager for the rule flags, the segment sizes and whether
    an id exceeds 1 (plus the one of :func:`build_packed_sequence_metadata`
    where metadata is required); unbacked sizes under torch.compile.
    """
    batch, sequence = document_ids.shape
    reads: list[torch.Tensor] = []
    bounds: list[int] = []
    varlen = None
    if mask_type == "flash_varlen":
        varlen = _ops.physical_varlen_metadata(document_ids)
        reads += [varlen.num_segments, varlen.max_seqlen]
        bounds += [batch * sequence, sequence]
    if not needs_metadata:
        reads.append((document_ids.max() > 1).to(torch.int64))
        bounds.append(1)
    # Only the block-causal mask checks the ids, as the collater's does.
    flags = broken if broken is not None else torch.zeros(3, dtype=torch.bool, device=document_ids.device)
    ints = checked_ints(reads, bounds, flags, _ops.document_rules(document_ids))
    if varlen is not None:
        segments, longest = ints[:2]
        result.update(
            to_flash_attention_kwargs(PackedSeqParams(varlen.cu_seqlens[: segments + 1], longest, document_ids))
        )
    if needs_metadata:
        result.update(build_packed_sequence_metadata(document_ids))
    if needs_metadata or ints[-1]:
        result["_packed_seq_ids"] = document_ids
    return result


def _passthrough(document_ids: torch.Tensor, **tensors: torch.Tensor | None) -> dict[str, Any]:
    """The given ``[batch, sequence]`` tensors, in order, for the result dict."""
    result: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.shape != document_ids.shape:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must have the shape of document_ids {tuple(document_ids.shape)}, got {shape}")
        result[name] = tensor
    return result


# --------------------------------------------------------------- unpad / pad


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
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.ndim < minimum_rank:
        shape = "[batch, sequence, ...]" if minimum_rank == 2 else "[batch * sequence, ...]"
        raise ValueError(f"values must have shape {shape}, got {tuple(values.shape)}")


def unpad(values: torch.Tensor, metadata: VarlenMetadata) -> torch.Tensor:
    """Move activations into varlen token order: valid tokens first, then zeros.

    NOTE [Unpad and pad are each other's backward] in :mod:`packfn._ops.attention`.

    Args:
        values: ``[batch, sequence, ...]``, any dtype.
        metadata: :class:`packfn.VarlenMetadata` of the batch's mask.

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
    if values.shape[1] != sequence or values.shape[0] * sequence != indices.numel():
        raise ValueError(
            f"values {tuple(values.shape)} do not match the mask's [batch, sequence] = "
            f"[{indices.numel() // sequence}, {sequence}]"
        )
    return _ops.unpad(values, indices, num_tokens)


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
    if values.shape[0] != indices.numel():
        raise ValueError(f"values {tuple(values.shape)} must have batch * sequence = {indices.numel()} rows")
    padded, broken = _ops.pad(values, indices, num_tokens, sequence)
    assert_rules(broken, _ops.PAD_RULES)
    return padded
