"""The example model: a small decoder over packed rows, every packing step a packfn op with static shapes.

The scripts train it (``scripts/main_job.py``, on packfn's and on NeMo
AutoModel's pipelines), export it (``scripts/export.py``) and run it on a GPU
(``scripts/gpu_check.py``); ``scripts/batches.py`` makes its batches and
``scripts/upstream.py`` drives the same weights through NeMo AutoModel's
helpers. Importing it has no side effects (no compile, no upstream import).

The model takes token ids ``[batch, sequence]`` and either a document-id mask
``[batch, sequence]`` (1-based ids, 0 at padding, the packing format of
:mod:`packfn._ops.metadata`) or ``seq_lens`` ``[batch, documents]``. With packfn,
everything between the mask and the attention kernel has static shapes:

1. :func:`packfn.batch_metadata` parses the mask into row-local boundaries
   ``[batch, D + 1]``, hence the lengths ``[batch, D]`` (``D`` = the packer's cap);
2. :func:`packfn.aligned_layout` aligns each document start to
   ``alignment`` columns in rows of the fixed length ``budget``, which the
   packer guarantees every batch fits (without a packer:
   :func:`packfn.safe_budget`, the worst case);
3. ``pack`` moves the embeddings into the aligned rows; ``position_ids`` of the
   layout drive RoPE; :func:`packfn.block_causal_mask` of the layout's
   ``sequence_ids`` is the SDPA mask (or, on a GPU, a FlexAttention
   ``BlockMask`` from :func:`packfn.document_block_mask`);
4. ``restore`` brings the hidden states back to the input columns for the LM head.

:meth:`PackedDecoder.decode` is the network given any layout and mask: the
upstream driver calls it with the layout and the dense mask its own helpers build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from packfn import (
    PackedSequenceLayout,
    aligned_layout,
    batch_metadata,
    block_causal_mask,
    document_block_mask,
    safe_budget,
)

__all__ = ["IGNORE_INDEX", "DecoderConfig", "PackedDecoder", "lengths_from_boundaries", "packed_loss"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class DecoderConfig:
    """Model and packing sizes: ``max_documents`` (``D``) and ``budget`` are the packer's.

    ``budget`` is the aligned row length; ``None`` takes the worst case
    :func:`packfn.safe_budget` (fits any batch, packed or not).
    """

    sequence: int = 512
    max_documents: int = 16
    budget: int | None = None
    vocab: int = 256
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    alignment: int = 16
    attention: str = "sdpa"  # "sdpa" (block-causal bool mask) or "flex" (BlockMask; GPU only for training)
    flex_block_size: int = 128

    @property
    def length(self) -> int:
        """The aligned row length: ``budget``, else the worst case of ``max_documents`` documents in ``sequence``."""
        if self.budget is not None:
            return self.budget
        return safe_budget(self.sequence, self.max_documents, self.alignment)


# ---------------------------------------------------------------- the model


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half form) at arbitrary integer positions."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inverse = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inverse_frequency", inverse, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, length]`` int64 positions to ``cos``, ``sin`` ``[batch, 1, length, head_dim]``."""
        angles = position_ids.unsqueeze(-1).to(torch.float32) * self.inverse_frequency
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Block(nn.Module):
    """Pre-norm attention and MLP block over packed rows ``[batch, length, hidden]``."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.attention_norm = nn.RMSNorm(config.hidden)
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=False)
        self.out = nn.Linear(config.hidden, config.hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(config.hidden)
        self.up = nn.Linear(config.hidden, 4 * config.hidden, bias=False)
        self.down = nn.Linear(4 * config.hidden, config.hidden, bias=False)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask) -> torch.Tensor:
        batch, length, width = hidden.shape
        qkv = self.qkv(self.attention_norm(hidden)).view(batch, length, 3, self.heads, width // self.heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, length, head_dim]
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        if isinstance(mask, torch.Tensor):
            # Padding queries have an all-False row: SDPA returns zeros there (no NaN, in forward and backward).
            attended = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        else:
            attended = flex_attention(query, key, value, block_mask=mask)
        hidden = hidden + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return hidden + self.down(F.gelu(self.up(self.mlp_norm(hidden))))


def lengths_from_boundaries(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Row-local boundaries ``[batch, D + 1]`` (-1 after each row's last) to lengths ``[batch, D]``, 0 when absent."""
    ends = cu_seqlens[:, 1:]
    return torch.where(ends >= 0, ends - cu_seqlens[:, :-1], 0)


class PackedDecoder(nn.Module):
    """Embedding, ``layers`` attention + MLP blocks and an LM head over packed rows (see the module docstring)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        if config.hidden % config.heads or (config.hidden // config.heads) % 2:
            raise ValueError(f"hidden={config.hidden} must split into {config.heads} heads of even width")
        if config.attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', got {config.attention!r}")
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.rotary = Rotary(config.hidden // config.heads)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)

    def layout(self, document_ids: torch.Tensor | None, seq_lens: torch.Tensor | None) -> PackedSequenceLayout:
        """The aligned layout of a batch, from its document-id mask or its ``[batch, D]`` lengths (static shapes)."""
        config = self.config
        if seq_lens is None:
            if document_ids is None:
                raise ValueError("pass document_ids [batch, sequence] or seq_lens [batch, documents]")
            metadata = batch_metadata(document_ids, max_documents=config.max_documents)
            seq_lens = lengths_from_boundaries(metadata.cu_seqlens)
        return aligned_layout(
            seq_lens, sequence_length=config.sequence, alignment=config.alignment, budget=config.length
        )

    def forward(
        self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[batch, sequence, vocab]`` of ``input_ids`` ``[batch, sequence]`` (zeros-in at padding)."""
        layout = self.layout(document_ids, seq_lens)
        if self.config.attention == "flex":
            mask = document_block_mask(layout.sequence_ids, block_size=self.config.flex_block_size)
        else:
            mask = block_causal_mask(layout.sequence_ids)
        return self.decode(input_ids, layout, mask)

    def decode(self, input_ids: torch.Tensor, layout: PackedSequenceLayout, mask) -> torch.Tensor:
        """The network proper, given a layout and an attention mask (shared by the packfn and upstream drivers)."""
        hidden = layout.pack(self.embed(input_ids))
        cos, sin = self.rotary(layout.position_ids)
        for block in self.blocks:
            hidden = block(hidden, cos, sin, mask)
        return self.lm_head(self.norm(layout.restore(hidden)))


def packed_loss(
    model: PackedDecoder, input_ids: torch.Tensor, document_ids: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross entropy over labelled tokens (static shapes: ``IGNORE_INDEX`` masks the rest)."""
    logits = model(input_ids, document_ids)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
