"""What the Trainer tests share: tiny documents and models, and the loss of every document run alone."""

from __future__ import annotations

import torch
import transformers

from tests.integrations import SIZES


def documents(count: int = 40, longest: int = 24, seed: int = 0) -> list[list[int]]:
    """``count`` token lists of 2 to ``longest - 1`` tokens (ids 1 to vocabulary - 1)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, longest, (count,), generator=generator).tolist()
    return [torch.randint(1, SIZES["vocab_size"], (n,), generator=generator).tolist() for n in lengths]


def tiny_llama(implementation: str = "sdpa", seed: int = 0) -> transformers.LlamaForCausalLM:
    """A 2-layer Llama from a config (random weights, seeded), in train mode."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SIZES, attn_implementation=implementation)
    return transformers.LlamaForCausalLM(config).train()


def document_pieces(batch: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(tokens, labels)`` of every document of a packed batch, read off its document ids."""
    pieces = []
    for ids, tokens, labels in zip(batch["document_ids"], batch["input_ids"], batch["labels"], strict=True):
        for document in ids.unique().tolist():
            if document:
                where = ids == document
                pieces.append((tokens[where], labels[where]))
    return pieces


def per_document_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], label_smoothing: float = 0.0
) -> torch.Tensor:
    """The mean next-token loss of every document of ``batch`` run alone (targets: its labels that are not -100).

    ``label_smoothing`` as ``torch.nn.functional.cross_entropy`` takes it (transformers' ``LabelSmoother``'s loss).
    """
    total, targets = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for tokens, labels in document_pieces(batch):
            logits = type(model).forward(model, input_ids=tokens[None]).logits[0, :-1].double()
            total += torch.nn.functional.cross_entropy(
                logits, labels[1:], ignore_index=-100, reduction="sum", label_smoothing=label_smoothing
            )
            targets += int((labels[1:] != -100).sum())
    return total / targets
