"""Attention masks of a packed batch: the dense block-causal mask and FlexAttention's.

The packing format is described once, in :mod:`packfn.metadata`; the
mask is ``document_ids``. A query attends the keys of its row that are not
after it and carry its id; padding attends nothing and nothing attends it.
For the example mask ``[[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]``, query 3
(document 2) attends keys 2 and 3.

- ``"block_causal"`` (:data:`packfn.AttentionInputKind`): :func:`block_causal_mask`,
  bool ``[batch, 1, sequence, sequence]``; ``"additive_mask"``: :func:`additive_mask` of it.
- ``"block_mask"``, FlexAttention: :func:`document_mask_mod` and :func:`document_block_mask`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from packfn._checks import check_mask, check_positive_int, check_same_device
from packfn._ops import masks as _ops
from packfn._ops._registry import assert_rules
from packfn._ops.metadata import mask_rules

__all__ = [
    "additive_mask",
    "block_causal_mask",
    "causal_band_mask",
    "check_window",
    "checked_block_mask",
    "document_block_mask",
    "document_mask_mod",
]


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
    check_mask(document_ids)
    mask, broken = _ops.block_causal_mask_op(document_ids, True)
    assert_rules(broken, mask_rules(document_ids.shape[1]))
    return mask


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as eager attention adds it to the scores: 0 where True, ``dtype``'s minimum where False.

    Adding a bool mask would add 0 and 1; transformers' own eager masks are
    additive in the model's dtype.
    """
    return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def causal_band_mask(first_columns: torch.Tensor, *, invert: bool = False) -> torch.Tensor:
    """The dense block-causal mask of contiguous documents, from each token's document start, in two passes.

    For documents without padding (EOS-delimited streams, ``seq_lens``
    tables), query ``i`` attends exactly the keys ``first_columns[i] <= j <= i``:
    a band, so the ``[sequence, sequence]`` mask is one comparison and one
    ``tril``, with no id comparison. The eager drop-ins' dense masks
    (:mod:`packfn.integrations.megatron`, :mod:`packfn.integrations.torchtune`) use it.

    Args:
        first_columns: int ``[batch, sequence]``: the column each token's
            document begins at.
        invert: Return True where a key is *not* attended (Megatron's convention).

    Returns:
        Bool ``[batch, sequence, sequence]``.
    """
    columns = torch.arange(first_columns.shape[1], device=first_columns.device)
    mask = torch.ge(columns, first_columns.unsqueeze(2)).tril_()
    return mask.logical_not_() if invert else mask


def check_window(window: object, name: str = "window") -> int | None:
    """Return ``window`` if it is None or a positive int, else raise."""
    return None if window is None else check_positive_int(window, name)


def _check_positions(positions: object, document_ids: torch.Tensor) -> None:
    if positions is None:
        return
    signed = (torch.int8, torch.int16, torch.int32, torch.int64)
    if not isinstance(positions, torch.Tensor) or positions.dtype not in signed:
        kind = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise TypeError(
            f"positions must be a signed integer tensor, such as packed_position_ids(document_ids), got {kind}"
        )
    if positions.shape != document_ids.shape:
        raise ValueError(
            f"positions must have the shape of document_ids {tuple(document_ids.shape)}, got {tuple(positions.shape)}"
        )
    check_same_device(positions, "positions", document_ids, "document_ids")


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
    check_mask(document_ids)
    window = check_window(window)
    _check_positions(positions, document_ids)
    return _mask_mod(document_ids, window, positions)


def _mask_mod(
    document_ids: torch.Tensor, window: int | None, positions: torch.Tensor | None
) -> Callable[..., torch.Tensor]:
    """:func:`document_mask_mod` of checked arguments."""

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
            They must increase along each document's valid tokens (as
            :func:`packed_position_ids` does): the tables are found from
            each block's first and last valid positions, and are not checked
            against positions that go back (the ``mask_mod`` still follows
            them, so eager FlexAttention on the CPU, which ignores the
            tables, would hide the difference).

    Returns:
        A ``BlockMask`` with one head (broadcast over heads), ``kv_num_blocks``
        int32 ``[batch, 1, blocks]`` and ``kv_indices`` int32
        ``[batch, 1, blocks, blocks]`` (present blocks ascending, then the
        others), the same for full blocks, and ``mask_mod`` from
        :func:`document_mask_mod`.

    ``torch.export`` with a ``Dim`` on the sequence takes it only as a
    multiple of ``block_size`` of at least two blocks
    (``dynamic_shapes={1: block_size * Dim("blocks", min=2)}``): for any
    other length torch's shape reasoning over the ``[blocks, blocks]`` tables
    guards on ``ceil(S / block_size) ** 2 != ceil(S / block_size)``, which the
    solver cannot prove.

    Raises:
        ValueError / TypeError: as :func:`block_causal_mask`, or a
            non-positive ``block_size`` / ``window``.
        RuntimeError: as :func:`block_causal_mask`.
    """
    check_mask(document_ids)
    block_size = check_positive_int(block_size, "block_size")
    window = check_window(window)
    if not isinstance(separate_full_blocks, bool):
        raise TypeError(f"separate_full_blocks must be a bool, got {type(separate_full_blocks).__name__}")
    _check_positions(positions, document_ids)
    return checked_block_mask(document_ids, block_size, window, separate_full_blocks, positions, check=True)


def checked_block_mask(
    document_ids: torch.Tensor,
    block_size: int,
    window: int | None,
    separate_full_blocks: bool,
    positions: torch.Tensor | None,
    *,
    check: bool,
) -> BlockMask:
    """:func:`document_block_mask` of checked arguments; the mask's rules only with ``check`` (NOTE [Check once])."""
    tables = _ops.document_block_tables_op(document_ids, block_size, window, separate_full_blocks, positions, check)
    if check:
        assert_rules(tables.broken, mask_rules(document_ids.shape[1]))
    sequence = document_ids.shape[1]
    full = separate_full_blocks
    # The query-side tables come with the op (one kernel on CUDA), where BlockMask.from_kv_blocks would derive
    # them from the key side in about ten launches of its own.
    return BlockMask(
        seq_lengths=(sequence, sequence),
        kv_num_blocks=tables.kv_num_blocks,
        kv_indices=tables.kv_indices,
        full_kv_num_blocks=tables.full_kv_num_blocks if full else None,
        full_kv_indices=tables.full_kv_indices if full else None,
        q_num_blocks=tables.q_num_blocks,
        q_indices=tables.q_indices,
        full_q_num_blocks=tables.full_q_num_blocks if full else None,
        full_q_indices=tables.full_q_indices if full else None,
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=_mask_mod(document_ids, window, positions),
    )
