"""The example model's batches: from packfn's packer and loader, with the flags the scripts share.

A :class:`Batch` holds ``[batch, sequence]`` token ids, document ids (1-based,
0 at padding) and next-token labels, for :class:`examples.packed_decoder.PackedDecoder`
and :func:`examples.packed_decoder.packed_loss`. :func:`make_batches` packs a
stream of random documents with :func:`packfn.pack_stream`;
:func:`loader_batches` packs given documents with
:class:`packfn.data.PackedDataset`; :func:`scripts.upstream.neat_packing_batches`
makes the same records with NeMo AutoModel's packer.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from packfn import PackedBatch, pack_stream
from packfn.data import PackedDataset

from examples.packed_decoder import IGNORE_INDEX, DecoderConfig
from scripts.corpus import document_lengths

__all__ = [
    "Batch",
    "add_model_arguments",
    "batches_and_config",
    "decoder_config",
    "loader_batches",
    "make_batches",
    "pieces",
]


@dataclass(frozen=True)
class Batch:
    """One training batch: ``[batch, sequence]`` token ids, document ids (0 at padding) and next-token labels.

    ``packed`` is the packer's record when :func:`packfn.pack_stream` made
    the batch; batches from a loader or from upstream's packer carry their
    ``[batch, D]`` lengths and real-token count instead.
    """

    input_ids: torch.Tensor
    document_ids: torch.Tensor
    labels: torch.Tensor
    packed: PackedBatch | None = None  # the packer's record: rows, seq_lens [batch, D], budget, real tokens
    lengths: torch.Tensor | None = None
    tokens: int | None = None

    @property
    def seq_lens(self) -> torch.Tensor:
        """int64 ``[batch, D]`` document lengths, 0 for absent slots."""
        return self.packed.seq_lens if self.packed is not None else self.lengths

    @property
    def num_tokens(self) -> int:
        """Real tokens of the batch."""
        return self.packed.num_tokens if self.packed is not None else self.tokens

    def aligned_length(self, alignment: int) -> int:
        """The aligned row length upstream's ``packed_layout`` builds for this batch (its longest aligned row)."""
        aligned = (self.seq_lens.clamp_min(0) + alignment - 1) // alignment * alignment
        return max(int(aligned.sum(-1).max()), alignment)


def pieces(input_ids: torch.Tensor, seq_lens: torch.Tensor) -> list[list[int]]:
    """The tokens of every document (piece) in packed rows, row by row: what a second packer gets.

    Args:
        input_ids: int64 ``[batch, sequence]``, each row's documents back to
            back from column 0 (no span padding), then padding.
        seq_lens: int64 ``[batch, D]``, each row's document lengths, 0 for absent slots.
    """
    result = []
    for tokens, lengths in zip(input_ids.tolist(), seq_lens.tolist(), strict=True):
        column = 0
        for length in lengths:
            if length > 0:
                result.append(tokens[column : column + length])
            column += length
    return result


def make_batches(
    steps: int,
    *,
    batch: int,
    sequence: int,
    mean: int,
    vocab: int,
    alignment: int = 16,
    max_documents: int = 16,
    budget: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[Batch]:
    """``steps`` batches packed by :func:`packfn.pack_stream` from :func:`scripts.corpus.document_lengths`.

    Every batch has the same shape but different contents, so a compiled
    model that specialized on data would recompile. Token ids are drawn per
    document and laid out by :meth:`packfn.PackedBatch.gather`; labels are
    the next token of the same document (piece), ``IGNORE_INDEX`` at each
    piece's last token and at padding. A document longer than a row is cut
    into pieces (``split=True``).
    """
    stream = pack_stream(
        document_lengths(mean, seed),
        batch=batch,
        sequence=sequence,
        alignment=alignment,
        max_documents=max_documents,
        budget=budget,
        split=True,  # a document longer than a row (rare at these means) is cut into pieces
    )
    generator = torch.Generator().manual_seed(10_000 + seed)
    result = []
    for packed in (next(stream) for _ in range(steps)):
        tokens = {
            index: torch.randint(0, vocab, (length,), generator=generator)
            for index, length in sorted(packed.document_lengths.items())
        }
        input_ids = packed.gather(tokens)
        document_ids = packed.document_ids
        same_document = (document_ids[:, 1:] == document_ids[:, :-1]) & (document_ids[:, 1:] != 0)
        labels = F.pad(torch.where(same_document, input_ids[:, 1:], IGNORE_INDEX), (0, 1), value=IGNORE_INDEX)
        result.append(Batch(input_ids.to(device), document_ids.to(device), labels.to(device), packed))
    return result


def loader_batches(
    documents: list[list[int]],
    *,
    batch: int,
    sequence: int,
    alignment: int,
    max_documents: int,
    budget: int | None = None,
    device: str | torch.device = "cpu",
) -> list[Batch]:
    """Every full batch :class:`packfn.data.PackedDataset` packs from ``documents`` (``split=True``, best fit).

    Labels are the loader's ``shift_labels``: each token's next token in its
    document (piece), ``IGNORE_INDEX`` at its last token and at padding.
    """
    dataset = PackedDataset(
        documents,
        batch=batch,
        sequence=sequence,
        alignment=alignment,
        max_documents=max_documents,
        budget=budget,
        split=True,
        drop_last=True,
    )
    return [
        Batch(
            item["input_ids"].to(device),
            item["document_ids"].to(device),
            item["shift_labels"].to(device),
            lengths=item["seq_lens"].to(device),
            tokens=int(item["seq_lens"].sum()),
        )
        for item in dataset
    ]


def add_model_arguments(
    parser: argparse.ArgumentParser, *, batch: int, sequence: int, mean: int, hidden: int, layers: int, vocab: int
) -> None:
    """The model and input flags the scripts share, with a script's defaults."""
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--sequence", type=int, default=sequence)
    parser.add_argument("--mean", type=int, default=mean, help="mean document length (exponential draw)")
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--alignment", type=int, default=16, help="alignment of document starts in packed rows")
    parser.add_argument("--max-documents", type=int, default=16, help="the packer's cap of documents per row (D)")
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="aligned row length the packer fills to, a multiple of --alignment (default: --sequence rounded up)",
    )
    parser.add_argument("--device", default="cpu")


def decoder_config(arguments: argparse.Namespace, budget: int) -> DecoderConfig:
    """The model of the flags of :func:`add_model_arguments` (and ``--attention``), in rows of ``budget`` columns."""
    return DecoderConfig(
        sequence=arguments.sequence,
        max_documents=arguments.max_documents,
        budget=budget,
        vocab=arguments.vocab,
        hidden=arguments.hidden,
        layers=arguments.layers,
        heads=arguments.heads,
        alignment=arguments.alignment,
        attention=getattr(arguments, "attention", "sdpa"),
    )


def batches_and_config(arguments: argparse.Namespace, steps: int) -> tuple[list[Batch], DecoderConfig]:
    """``steps`` packed batches from the flags of :func:`add_model_arguments`, and the config of their budget."""
    batches = make_batches(
        steps,
        batch=arguments.batch,
        sequence=arguments.sequence,
        mean=arguments.mean,
        vocab=arguments.vocab,
        alignment=arguments.alignment,
        max_documents=arguments.max_documents,
        budget=arguments.budget,
        device=arguments.device,
    )
    return batches, decoder_config(arguments, batches[0].packed.budget)
