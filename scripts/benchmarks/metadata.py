"""Mask parsing: upstream eager against packfn's drop-ins (eager) and static ops (eager, compiled)."""

from __future__ import annotations

import packfn
import packfn.nemo_automodel

from scripts.benchmarks.common import FLOOR, Case, Inputs, compiled_variant, floor_variant

try:
    from nemo_automodel.components.datasets import packing as upstream
    from nemo_automodel.components.models.common import packing as upstream_models
except ImportError:  # the benchmark still measures packfn alone
    upstream = upstream_models = None


def cases(inputs: Inputs) -> list[Case]:
    mask, capacity = inputs.document_ids, inputs.max_documents
    batch, sequence = mask.shape

    def static_flat(mask):
        return packfn.varlen_metadata(mask, max_documents=capacity)

    def static_batch(mask):
        return packfn.batch_metadata(mask, max_documents=capacity)

    def static_flat_default(mask):
        return packfn.varlen_metadata(mask)

    def static_batch_default(mask):
        return packfn.batch_metadata(mask)

    metadata = packfn.nemo_automodel.build_packed_sequence_metadata(mask)
    indices, bounds = metadata["packed_token_indices"], metadata["cu_seqlens"]
    narrow_bounds = packfn.batch_metadata(mask, max_documents=capacity).cu_seqlens

    def static_flatten(indices, bounds):
        return packfn.flatten_metadata(indices, bounds)

    shape = {"batch_size": batch, "sequence_length": sequence}
    families = [
        (
            "get_unpad_data",
            upstream and (lambda: upstream.get_unpad_data(mask)),
            lambda: packfn.nemo_automodel.get_unpad_data(mask),
            lambda: static_flat(mask),
            compiled_variant(static_flat, mask),
            compiled_variant(static_flat_default, mask),
        ),
        (
            "build_packed_sequence_metadata",
            upstream and (lambda: upstream.build_packed_sequence_metadata(mask)),
            lambda: packfn.nemo_automodel.build_packed_sequence_metadata(mask),
            lambda: static_batch(mask),
            compiled_variant(static_batch, mask),
            compiled_variant(static_batch_default, mask),
        ),
        (
            "get_seqlens_in_batch",
            upstream and (lambda: upstream.get_seqlens_in_batch(mask)),
            lambda: packfn.nemo_automodel.get_seqlens_in_batch(mask),
            lambda: static_flat(mask),
            compiled_variant(static_flat, mask),
            None,
        ),
        (
            "flatten_packed_sequence_metadata",
            upstream_models and (lambda: upstream_models.flatten_packed_sequence_metadata(indices, bounds, **shape)),
            lambda: packfn.nemo_automodel.flatten_packed_sequence_metadata(indices, bounds, **shape),
            lambda: static_flatten(indices, narrow_bounds),
            compiled_variant(static_flatten, indices, narrow_bounds),
            None,
        ),
    ]
    result = []
    for name, reference, drop_in, static_eager, static_compiled, default_compiled in families:
        variants = {"packfn drop-in eager": drop_in, "packfn static eager": static_eager}
        variants["packfn static compiled"] = static_compiled
        if default_compiled:
            variants["packfn static compiled, D=sequence"] = default_compiled
        variants.update(floor_variant(mask))
        if reference:
            variants = {"upstream": reference, **variants}
        result.append(
            Case(
                "metadata",
                name,
                sequence,
                variants,
                baseline="upstream" if reference else "packfn drop-in eager",
                notes={"max_documents": str(capacity)},
                floor=FLOOR,
            )
        )
    return result
