"""A compiled varlen attention layer: unpad, attention within each ``cu_seqlens`` segment, pad.

``packfn.varlen_metadata`` gives the flat token order and fixed-size
``cu_seqlens`` of a packed batch with no host sync, so the whole forward is
one graph that never recompiles across batches of one shape. On a GPU the
segment attention is ``flash_attn_varlen_func(q, k, v, cu_seqlens,
cu_seqlens, bound, bound, causal=True)``; here it is SDPA with the
block-diagonal causal mask that function computes, so the example runs on a
CPU.

    python examples/varlen_forward.py --batch 2 --sequence 64
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import packfn


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``[tokens, heads, dim]`` rows within each ``[cu_seqlens[i], cu_seqlens[i + 1])`` segment."""
    rows = torch.arange(q.shape[0], device=q.device)
    segment = torch.searchsorted(cu_seqlens, rows.to(cu_seqlens.dtype), right=True)
    mask = (segment[:, None] == segment[None, :]) & (rows[:, None] >= rows[None, :])
    heads_first = [tensor.transpose(0, 1) for tensor in (q, k, v)]
    return F.scaled_dot_product_attention(*heads_first, attn_mask=mask).transpose(0, 1)


class VarlenAttention(torch.nn.Module):
    """Self-attention over the real tokens of a packed batch, each document on its own."""

    def __init__(self, hidden: int, heads: int, max_documents: int) -> None:
        super().__init__()
        self.heads, self.max_documents = heads, max_documents
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:  # [B, S, hidden], [B, S]
        meta = packfn.varlen_metadata(document_ids, max_documents=self.max_documents)
        tokens = packfn.unpad(x, meta)  # [B * S, hidden]: real tokens in cu_seqlens order, then zeros
        q, k, v = self.qkv(tokens).unflatten(1, (3, self.heads, -1)).unbind(1)
        attended = segment_attention(q, k, v, meta.cu_seqlens)
        return packfn.pad(self.out(attended.flatten(1)), meta)  # [B, S, hidden], zeros at padding


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batches", type=int, default=3)
    arguments = parser.parse_args(argv)
    torch.manual_seed(0)
    max_documents = 8
    model = VarlenAttention(arguments.hidden, heads=4, max_documents=max_documents)
    compiled = torch.compile(model, fullgraph=True)
    lengths = torch.randint(1, arguments.sequence // 2, (10_000,)).tolist()
    stream = packfn.pack_stream(
        lengths, batch=arguments.batch, sequence=arguments.sequence, alignment=1, max_documents=max_documents
    )
    with torch._dynamo.config.patch(error_on_recompile=True):  # one compile serves every batch of this shape
        for _, packed in zip(range(arguments.batches), stream, strict=False):
            x = torch.randn(arguments.batch, arguments.sequence, arguments.hidden)
            out = compiled(x, packed.document_ids)
            for row, pieces in enumerate(packed.rows):  # each document alone gives the same rows
                for piece in pieces:
                    columns = slice(piece.column, piece.column + piece.length)
                    alone = model(x[row : row + 1, columns], torch.ones(1, piece.length, dtype=torch.int64))
                    torch.testing.assert_close(out[row : row + 1, columns], alone, rtol=1e-4, atol=1e-5)
            assert out[packed.document_ids == 0].eq(0).all()
            print(
                f"{sum(map(len, packed.rows))} documents, fill {packed.fill_ratio:.3f}: packed == each document alone"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
