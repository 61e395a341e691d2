"""Attention inputs: upstream eager against packfn (eager, compiled) for block-causal masks, flash varlen, BlockMask."""

from __future__ import annotations

from torch.nn.attention.flex_attention import create_block_mask

import packfn
import packfn.nemo_automodel as nemo

from scripts.benchmarks.common import FLOOR, Case, Inputs, compiled_variant, floor_variant

try:
    from nemo_automodel.components.datasets import packed_seq as upstream
except ImportError:  # the benchmark still measures packfn alone
    upstream = None
try:  # imports transformers through its package
    from nemo_automodel.components.datasets.utils import _indexed_mask_to_4d_block_causal
except ImportError:
    _indexed_mask_to_4d_block_causal = None

DENSE_LIMIT = 8192
"""Above this sequence a dense ``[batch, sequence, sequence]`` mask does not fit (8 GiB of bool at 32768)."""


def _block_causal(inputs: Inputs) -> list[Case]:
    mask = inputs.document_ids
    variants = {}
    if _indexed_mask_to_4d_block_causal is not None:
        variants["upstream"] = lambda: _indexed_mask_to_4d_block_causal(mask)
    variants["packfn eager"] = lambda: packfn.block_causal_mask(mask)
    variants["packfn compiled"] = compiled_variant(packfn.block_causal_mask, mask)
    baseline = "upstream" if "upstream" in variants else "packfn eager"
    return [Case("attention", "block_causal_mask", inputs.sequence, variants, baseline)]


def _flash_varlen(inputs: Inputs, notes: dict[str, str]) -> list[Case]:
    mask = inputs.document_ids

    def static(mask):
        return packfn.physical_varlen_metadata(mask)

    variants = {}
    if upstream is not None:
        variants["upstream"] = lambda: upstream.to_flash_attention_kwargs(upstream.packed_seq_params_from_doc_ids(mask))
    variants["packfn drop-in eager"] = lambda: nemo.to_flash_attention_kwargs(nemo.packed_seq_params_from_doc_ids(mask))
    variants["packfn static eager"] = lambda: static(mask)
    variants["packfn static compiled"] = compiled_variant(static, mask)
    variants.update(floor_variant(mask))
    baseline = "upstream" if "upstream" in variants else "packfn drop-in eager"
    return [Case("attention", "packed_seq_params_from_doc_ids", inputs.sequence, variants, baseline, notes, FLOOR)]


def _block_mask(inputs: Inputs) -> list[Case]:
    mask = inputs.document_ids
    batch, sequence = mask.shape

    def reference(mask):
        return create_block_mask(packfn.document_mask_mod(mask), batch, 1, sequence, sequence, device=mask.device)

    notes = {"baseline": "create_block_mask with packfn.document_mask_mod (the documented FlexAttention path)"}
    variants = {}
    if sequence <= DENSE_LIMIT:
        variants["create_block_mask"] = lambda: reference(mask)
    else:
        notes["create_block_mask"] = (
            f"eager create_block_mask skipped above sequence {DENSE_LIMIT}: it materializes "
            "[batch, 1, sequence, sequence] masks and int64 index tensors (tens of GiB at 32768)"
        )
    variants["create_block_mask compiled"] = compiled_variant(reference, mask)
    variants["packfn eager"] = lambda: packfn.document_block_mask(mask)
    variants["packfn compiled"] = compiled_variant(packfn.document_block_mask, mask)
    baseline = "create_block_mask" if "create_block_mask" in variants else "create_block_mask compiled"
    return [Case("attention", "document_block_mask", sequence, variants, baseline, notes)]


def cases(inputs: Inputs) -> list[Case]:
    notes = {}
    result = []
    if inputs.sequence <= DENSE_LIMIT:
        result += _block_causal(inputs)
    else:
        notes["block_causal_mask"] = (
            f"block-causal case skipped above sequence {DENSE_LIMIT}: "
            f"a [{inputs.batch}, 1, {inputs.sequence}, {inputs.sequence}] bool mask is "
            f"{inputs.batch * inputs.sequence**2 / 2**30:.0f} GiB"
        )
    result += _flash_varlen(inputs, notes)
    result += _block_mask(inputs)
    return result
