"""A small packed-sequence decoder driven by packfn, and the same model driven by the upstream helpers.

Shared by ``scripts/main_job.py``, ``scripts/export.py`` and ``scripts/gpu_check.py``;
importing it has no side effects (no compile, no sys.path change, no upstream import).

Batches come from :func:`packfn.pack_stream` over a seeded stream of
exponential document lengths: every row fits ``max_documents`` documents and
the aligned budget (by default the input row length), so the model's static
budgets are the packer's, not the worst case of :func:`packfn.safe_budget`.

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

:func:`upstream_loss_function` runs the same weights through NeMo AutoModel
0.7.0's eager helpers instead (``build_packed_sequence_metadata``,
``packed_layout`` with its data-dependent row length or a fixed
``minimum_length``, its ``pack`` / ``restore`` and a dense block-causal mask
as ``_indexed_mask_to_4d_block_causal`` builds it) and reduces over the
tokens ``get_unpad_data`` selects.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from packfn import (
    PackedBatch,
    PackedSequenceLayout,
    aligned_layout,
    batch_metadata,
    block_causal_mask,
    document_block_mask,
    pack_stream,
    safe_budget,
)

__all__ = [
    "Batch",
    "DecoderConfig",
    "PackedDecoder",
    "add_model_arguments",
    "batches_and_config",
    "document_lengths",
    "eager_block_causal_mask",
    "lengths_from_boundaries",
    "loader_batches",
    "make_batches",
    "neat_packing",
    "neat_packing_batches",
    "packed_loss",
    "upstream_available",
    "upstream_loss",
    "upstream_loss_function",
]

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


# ------------------------------------------------------- the upstream driver


def upstream_available() -> bool:
    """True when NeMo AutoModel's packing helpers import (``pip install --no-deps nemo-automodel==0.7.0``)."""
    try:
        import nemo_automodel.components.datasets.packing
        import nemo_automodel.components.models.deepseek_v41.packing  # noqa: F401
    except ImportError:
        return False
    return True


def eager_block_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[batch, 1, sequence, sequence]``, computed as NeMo AutoModel's ``_indexed_mask_to_4d_block_causal``.

    Written out here because importing ``nemo_automodel.components.datasets.utils``
    pulls in transformers (tens of seconds).
    """
    sequence = attention_mask.shape[1]
    same_document = attention_mask.unsqueeze(2) == attention_mask.unsqueeze(1)
    causal = torch.ones(sequence, sequence, dtype=torch.bool, device=attention_mask.device).tril()
    valid = attention_mask > 0
    return (same_document & causal.unsqueeze(0) & valid.unsqueeze(2) & valid.unsqueeze(1)).unsqueeze(1)


def upstream_loss_function(*, minimum_length: int = 0, eager_helpers: bool = False) -> Callable[..., torch.Tensor]:
    """:func:`packed_loss` driven by the upstream helpers: a function of ``(model, input_ids, document_ids, labels)``.

    It runs :meth:`PackedDecoder.decode` on upstream's layout
    (``build_packed_sequence_metadata`` for the lengths, ``packed_layout``,
    a dense block-causal mask as ``_indexed_mask_to_4d_block_causal``
    builds it) and reduces over the real tokens ``get_unpad_data`` lists.

    Args:
        minimum_length: ``packed_layout``'s ``minimum_length``: 0 for
            upstream's data-dependent row length (the longest aligned row of
            the batch), or a packer's budget for rows of exactly that length.
        eager_helpers: Wrap the three helpers in ``torch.compiler.disable``:
            under ``torch.compile`` each call is then a graph break and runs
            eagerly, instead of being traced (tracing ``packed_layout``
            unrolls its per-document loop, so the graph specializes on every
            batch's lengths and recompiles; one dynamic-shape recompile of
            that frame took over five minutes on the 2-core machine). No
            effect in eager.
    """
    from nemo_automodel.components.datasets.packing import build_packed_sequence_metadata, get_unpad_data
    from nemo_automodel.components.models.deepseek_v41.packing import packed_layout

    helpers = (build_packed_sequence_metadata, packed_layout, get_unpad_data)
    if eager_helpers:
        helpers = tuple(torch.compiler.disable(helper) for helper in helpers)
    metadata_of, layout_of, unpad_data = helpers

    def loss(model: PackedDecoder, input_ids: torch.Tensor, document_ids: torch.Tensor, labels: torch.Tensor):
        metadata = metadata_of(document_ids)
        seq_lens = lengths_from_boundaries(metadata["cu_seqlens"])
        layout = layout_of(
            seq_lens,
            seq_lens_padded=None,
            input_shape=tuple(document_ids.shape),
            alignment=model.config.alignment,
            minimum_length=minimum_length,
        )
        logits = model.decode(input_ids, layout, eager_block_causal_mask(layout.sequence_ids))
        indices, _, _ = unpad_data(document_ids)
        return F.cross_entropy(
            logits.flatten(0, 1)[indices].float(), labels.flatten()[indices], ignore_index=IGNORE_INDEX
        )

    return loss


def upstream_loss(
    model: PackedDecoder,
    input_ids: torch.Tensor,
    document_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    minimum_length: int = 0,
) -> torch.Tensor:
    """:func:`packed_loss` with the upstream helpers (see :func:`upstream_loss_function`)."""
    return upstream_loss_function(minimum_length=minimum_length)(model, input_ids, document_ids, labels)


# ------------------------------------------------------------------ inputs


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


def document_lengths(mean: int, seed: int) -> Iterator[int]:
    """An endless seeded stream of document lengths: exponential with mean ``mean``, at least 1 token."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        for uniform in torch.rand(256, generator=generator, dtype=torch.float64).tolist():
            yield max(1, math.ceil(-mean * math.log1p(-uniform)))


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
    """``steps`` batches packed by :func:`packfn.pack_stream` from :func:`document_lengths` (``split=True``).

    Every batch has the same shape but different contents, so a compiled
    model that specialized on data would recompile. Token ids are drawn per
    document and laid out by :meth:`packfn.PackedBatch.gather`; labels are
    the next token of the same document (piece), ``IGNORE_INDEX`` at each
    piece's last token and at padding.
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


def add_model_arguments(parser, *, batch: int, sequence: int, mean: int, hidden: int, layers: int, vocab: int) -> None:
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


def batches_and_config(arguments, steps: int) -> tuple[list[Batch], DecoderConfig]:
    """``steps`` packed batches from the flags of :func:`add_model_arguments`, and the config of their budgets."""
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
    config = DecoderConfig(
        sequence=arguments.sequence,
        max_documents=arguments.max_documents,
        budget=batches[0].packed.budget,
        vocab=arguments.vocab,
        hidden=arguments.hidden,
        layers=arguments.layers,
        heads=arguments.heads,
        alignment=arguments.alignment,
        attention=getattr(arguments, "attention", "sdpa"),
    )
    return batches, config


# ------------------------------------------------------------------ whole pipelines on real tokens


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
    from packfn.data import PackedDataset

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


@functools.cache
def neat_packing():
    """NeMo AutoModel 0.7.0's ``datasets/llm/neat_packing.py`` module, loaded from its file.

    Its package's ``__init__`` imports modules that need Pillow, which the
    packing code itself does not; the module needs ``datasets`` (HF).
    """
    import importlib.util
    import os

    import nemo_automodel

    path = os.path.join(os.path.dirname(nemo_automodel.__file__), "components", "datasets", "llm", "neat_packing.py")
    spec = importlib.util.spec_from_file_location("nemo_automodel_neat_packing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def neat_packing_batches(
    documents: list[list[int]], *, batch: int, sequence: int, device: str | torch.device = "cpu"
) -> list[Batch]:
    """Every full batch NeMo AutoModel's neat packing makes of ``documents``, as its ``neat_pack_dataset`` does.

    Its packer has no split, so a document longer than a row is first cut
    into pieces of ``sequence`` tokens (what packfn's ``split=True`` cuts
    too). Then ``greedy_knapsack`` bins the pieces (longest first, each
    into the least-filled row that holds it) and ``_build_packed_sample``
    lays out each row: tokens, next-token labels within the piece, the
    1-based document-id ``attention_mask`` (0 at padding).
    """
    module = neat_packing()
    samples = []
    for ids in documents:
        for start in range(0, len(ids), sequence):
            piece = ids[start : start + sequence]
            samples.append({"input_ids": piece, "labels": [*piece[1:], IGNORE_INDEX]})
    bins = module.greedy_knapsack([len(sample["input_ids"]) for sample in samples], sequence)
    packs = [module._build_packed_sample([samples[index] for index in row], sequence, 0) for row in bins]
    result = []
    for begin in range(0, len(packs) - batch + 1, batch):
        rows = packs[begin : begin + batch]
        document_ids = torch.stack([row["attention_mask"] for row in rows])
        lengths = torch.nn.functional.one_hot(document_ids, int(document_ids.max()) + 1).sum(1)[:, 1:]
        result.append(
            Batch(
                torch.stack([row["input_ids"] for row in rows]).to(device),
                document_ids.to(device),
                torch.stack([row["labels"] for row in rows]).to(device),
                lengths=lengths.to(device),
                tokens=int((document_ids > 0).sum()),
            )
        )
    return result
