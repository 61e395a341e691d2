"""The packer feeding a compiled model: budgets from a sample, a resumable loader, one graph for every batch.

``packfn.suggest_budgets`` proposes the document cap from a sample of
lengths; ``packfn.data.PackedDataset`` packs tokenized documents under it
(best fit, every batch of one shape) in ``DataLoader`` workers; the model,
compiled once with ``fullgraph=True``, takes each batch's ``document_ids``
as its block-causal mask and never recompiles. Each document of a batch,
run alone, gives the same outputs.

    python examples/packer_to_model.py --batch 2 --sequence 64
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import packfn
from packfn.data import PackedDataset


class TinyDecoder(torch.nn.Module):
    """Embedding, one block-causal attention layer and an LM head over packed rows."""

    def __init__(self, vocab: int, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:  # [B, S] each
        x = self.embed(input_ids)
        batch, sequence, _ = x.shape
        q, k, v = self.qkv(x).view(batch, sequence, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = packfn.block_causal_mask(document_ids)  # bool [B, 1, S, S]: each document sees only itself
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape_as(x)
        return self.head(x + attended)  # [B, S, vocab]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    arguments = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    vocab = 100
    lengths = (torch.distributions.Exponential(1 / 20).sample((400,)).ceil().clamp(1, arguments.sequence)).long()
    documents = [torch.randint(1, vocab, (int(n),), generator=generator).tolist() for n in lengths]

    suggestion = packfn.suggest_budgets(lengths, sequence=arguments.sequence)
    print(
        f"suggest_budgets: max_documents={suggestion.max_documents} (a row held up to "
        f"{suggestion.most_documents} with no cap), fill {suggestion.fill:.3f}"
    )
    dataset = PackedDataset(
        documents, batch=arguments.batch, sequence=arguments.sequence, max_documents=suggestion.max_documents
    )
    loader = DataLoader(dataset, batch_size=None, num_workers=arguments.workers)

    torch.manual_seed(0)
    model = TinyDecoder(vocab).eval()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):  # one graph for every batch
        for _, batch in zip(range(arguments.batches), loader, strict=False):
            out = compiled(batch["input_ids"], batch["document_ids"])
            documents_checked = 0
            for row in range(arguments.batch):
                column = 0
                for length in batch["seq_lens"][row].tolist():
                    if length == 0:
                        continue
                    tokens = batch["input_ids"][row : row + 1, column : column + length]
                    alone = model(tokens, torch.ones_like(tokens))  # the document run by itself
                    torch.testing.assert_close(out[row : row + 1, column : column + length], alone)
                    column += length
                    documents_checked += 1
            print(f"{documents_checked} documents in {tuple(batch['input_ids'].shape)}: packed == each document alone")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
