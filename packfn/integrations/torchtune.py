"""torchtune: the packed collate function as a drop-in, and the same packs as packfn's static batch.

torchtune's ``PackedDataset`` gives each pack ``tokens``, ``labels``,
``input_pos`` and ``seq_lens``, the last entry of ``seq_lens`` being the
padding when the pack is not full; ``padded_collate_packed`` turns the
``seq_lens`` into a block-causal mask with a Python loop per document (a
dense ``[batch, sequence, sequence]`` mask on the CPU, a FlexAttention
``BlockMask`` on a CUDA GPU of compute capability 7.5 or more).

- :func:`padded_collate_packed` is that function: same signature, keys,
  values and errors, its document ids by one static op. Nothing here imports
  torchtune.
- :func:`collate_packed` gives the packs as packfn's static batch: the
  ``document_ids`` mask instead of a mask of ``sequence`` squared, the
  padding entry told apart from a document (its positions continue the last
  document's rather than restart) and given id 0.
"""

from __future__ import annotations

from typing import Any

import torch

from packfn._ops import formats as _format_ops
from packfn._ops._registry import assert_rules
from packfn.masks import causal_band_mask

__all__ = ["collate_packed", "packed_block_causal_mask", "padded_collate_packed"]


def _supports_flex_attention() -> bool:
    """torchtune's ``_SUPPORTS_FLEX_ATTENTION``: a CUDA GPU of compute capability 7.5 or more."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (7, 5)


def _common_length(seq_lens: list[torch.Tensor]) -> int:
    """The packs' length (what their ``seq_lens`` add up to); torchtune's ``stack`` error where they differ."""
    totals = [int(lengths.sum()) for lengths in seq_lens]
    if len(set(totals)) > 1:
        # torchtune stacks one [n, n] mask per pack: the same error, from the same call on meta tensors.
        torch.stack([torch.empty(n, n, dtype=torch.bool, device="meta") for n in totals])
    return totals[0]


def _seq_lens_table(seq_lens: list[torch.Tensor]) -> torch.Tensor:
    """int64 ``[batch, D]``: each pack's lengths, then zeros."""
    width = max(1, max(lengths.numel() for lengths in seq_lens))
    table = torch.zeros(len(seq_lens), width, dtype=torch.int64, device=seq_lens[0].device)
    for row, lengths in enumerate(seq_lens):
        table[row, : lengths.numel()] = lengths
    return table


def _document_ids(table: torch.Tensor, sequence: int) -> torch.Tensor:
    ids, broken = _format_ops.document_ids_from_seq_lens_op(table, sequence)
    assert_rules(broken, _format_ops.SEQ_LENS_RULES)
    return ids


def packed_block_causal_mask(seq_lens: list[torch.Tensor]) -> Any:
    """torchtune's ``packed_block_causal_mask``: the block-causal mask of packs given by their ``seq_lens``.

    Args:
        seq_lens: One 1-d tensor per pack, adding up to the same length.

    Returns:
        On a CUDA GPU of capability 7.5 or more, a FlexAttention ``BlockMask``
        over ``"cuda"`` (as torchtune builds it); else bool
        ``[batch, sequence, sequence]``, True where a query attends a key
        (every entry of ``seq_lens``, the padding one too, a causal block).

    Raises:
        RuntimeError: the packs differ in length (torchtune's ``stack`` error).
    """
    sequence = _common_length(seq_lens)
    ids = _document_ids(_seq_lens_table(seq_lens), sequence)  # 1-based slots; the padding entry is one more document
    if _supports_flex_attention():
        from torch.nn.attention.flex_attention import create_block_mask

        documents = ids.to("cuda") - 1

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (documents[b, q_idx] == documents[b, kv_idx])

        return create_block_mask(mask_mod, ids.shape[0], None, sequence, sequence, device="cuda")
    # Every document is contiguous: each token's first column is its column minus its position.
    positions = _format_ops.position_ids_op(ids).position_ids
    return causal_band_mask(torch.arange(sequence, device=ids.device) - positions)


def padded_collate_packed(batch: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """torchtune's ``padded_collate_packed``: stack the packs and turn their ``seq_lens`` into a block-causal mask.

    Args:
        batch: ``PackedDataset`` packs: ``tokens``, ``labels``, ``input_pos``
            (each ``[sequence]``) and ``seq_lens``.

    Returns:
        ``{"tokens", "labels", "input_pos"}`` stacked to ``[batch, sequence]``
        and ``"mask"`` from :func:`packed_block_causal_mask`.
    """
    tokens = torch.stack([x["tokens"] for x in batch])
    labels = torch.stack([x["labels"] for x in batch])
    input_pos = torch.stack([x["input_pos"] for x in batch])
    mask = packed_block_causal_mask([x["seq_lens"] for x in batch])
    return {"tokens": tokens, "labels": labels, "input_pos": input_pos, "mask": mask}


def _is_padding_entry(pack: dict[str, torch.Tensor]) -> bool:
    """Whether the last ``seq_lens`` entry is ``PackedDataset``'s padding.

    Every document but a pack's first (which may continue a document split
    across packs) begins at position 0; the padding entry's positions continue
    the last document's instead.
    """
    seq_lens, input_pos = pack["seq_lens"], pack["input_pos"]
    if seq_lens.numel() < 2 or int(seq_lens[-1]) == 0:
        return False
    return int(input_pos[input_pos.numel() - int(seq_lens[-1])]) != 0


def collate_packed(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """torchtune packs as packfn's static batch: ``tokens``, ``labels``, ``input_pos`` and ``document_ids``.

    ``document_ids`` is int64 ``[batch, sequence]``: each pack's documents
    numbered from 1 in order, 0 at the padding entry, for
    :func:`packfn.block_causal_mask`, :func:`packfn.document_block_mask`,
    :func:`packfn.varlen_metadata` and the rest inside the compiled step.

    Raises:
        RuntimeError: the packs differ in length.
    """
    tokens = torch.stack([x["tokens"] for x in batch])
    labels = torch.stack([x["labels"] for x in batch])
    input_pos = torch.stack([x["input_pos"] for x in batch])
    seq_lens = [x["seq_lens"][:-1] if _is_padding_entry(x) else x["seq_lens"] for x in batch]
    document_ids = _document_ids(_seq_lens_table(seq_lens), tokens.shape[1])
    return {"tokens": tokens, "labels": labels, "input_pos": input_pos, "document_ids": document_ids}
