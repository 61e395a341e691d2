"""NeMo AutoModel 0.7.0's side of the comparisons: its neat packing, and the example model driven by its helpers.

:func:`upstream_loss_function` runs the weights of
:class:`examples.packed_decoder.PackedDecoder` through upstream's eager
helpers instead of packfn's ops (``build_packed_sequence_metadata``,
``packed_layout`` with its data-dependent row length or a fixed
``minimum_length``, its ``pack`` / ``restore`` and a dense block-causal mask
as ``_indexed_mask_to_4d_block_causal`` builds it) and reduces over the
tokens ``get_unpad_data`` selects. :func:`neat_packing_batches` packs
documents as upstream's ``neat_pack_dataset`` does. Importing this module
imports nothing of upstream's (``pip install --no-deps nemo-automodel==0.7.0``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from examples.packed_decoder import IGNORE_INDEX, PackedDecoder, lengths_from_boundaries
from scripts.batches import Batch

__all__ = [
    "eager_block_causal_mask",
    "neat_packing",
    "neat_packing_batches",
    "upstream_available",
    "upstream_loss",
    "upstream_loss_function",
]


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
    """The example model's loss, driven by the upstream helpers: ``loss(model, input_ids, document_ids, labels)``.

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
    """The example model's loss with the upstream helpers (see :func:`upstream_loss_function`)."""
    return upstream_loss_function(minimum_length=minimum_length)(model, input_ids, document_ids, labels)


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
        lengths = F.one_hot(document_ids, int(document_ids.max()) + 1).sum(1)[:, 1:]
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
