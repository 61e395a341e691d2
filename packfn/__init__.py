"""packfn: packed-sequence metadata as compilable, exportable torch.library ops.

Three layers: :mod:`packfn.contract` (what a model asks for, pure Python),
:mod:`packfn._ops` (the ``packfn::*`` ops: fake, eager kernel, Inductor
decomposition, autograd) and the public functions below, each a static
(fixed-capacity, sync-free) form and, where NeMo AutoModel 0.7.0 has one, an
exact drop-in.
"""

import packfn._ops  # noqa: F401  (registers every op)
from packfn._cache import cache_key_tag, install_cache_key_tag
from packfn.attention import (
    PackedSeqParams,
    PhysicalVarlenMetadata,
    block_causal_mask,
    document_block_mask,
    document_mask_mod,
    packed_attention_inputs,
    packed_position_ids,
    packed_seq_params_from_doc_ids,
    pad,
    physical_varlen_metadata,
    to_flash_attention_kwargs,
    unpad,
)
from packfn.contract import (
    DEFAULT_PACKED_SEQUENCE_CONTRACT,
    PackedMaskType,
    PackedSequenceContract,
    resolve_packing_contract,
)
from packfn.distributed import (
    CPShard,
    CPVarlenMetadata,
    ShardLayout,
    cp_block_causal_mask,
    cp_document_block_mask,
    cp_varlen_metadata,
    gather_sequence,
    shard_cp_batch,
    shard_packed_batch,
    split_batch_metadata,
)
from packfn.hf import hf_model_inputs
from packfn.layout import PackedSequenceLayout, aligned_layout, aligned_length, packed_layout
from packfn.metadata import (
    BatchMetadata,
    PackedSequenceMetadata,
    VarlenMetadata,
    batch_metadata,
    build_packed_sequence_metadata,
    flatten_metadata,
    flatten_packed_sequence_metadata,
    get_seqlens_in_batch,
    get_unpad_data,
    varlen_metadata,
)
from packfn.packer import PackedBatch, pack_documents, pack_stream

__all__ = [
    "DEFAULT_PACKED_SEQUENCE_CONTRACT",
    "BatchMetadata",
    "CPShard",
    "CPVarlenMetadata",
    "PackedBatch",
    "PackedMaskType",
    "PackedSeqParams",
    "PackedSequenceContract",
    "PackedSequenceLayout",
    "PackedSequenceMetadata",
    "PhysicalVarlenMetadata",
    "ShardLayout",
    "VarlenMetadata",
    "aligned_layout",
    "aligned_length",
    "batch_metadata",
    "block_causal_mask",
    "build_packed_sequence_metadata",
    "cache_key_tag",
    "cp_block_causal_mask",
    "cp_document_block_mask",
    "cp_varlen_metadata",
    "document_block_mask",
    "document_mask_mod",
    "flatten_metadata",
    "flatten_packed_sequence_metadata",
    "gather_sequence",
    "get_seqlens_in_batch",
    "get_unpad_data",
    "hf_model_inputs",
    "pack_documents",
    "pack_stream",
    "packed_attention_inputs",
    "packed_layout",
    "packed_position_ids",
    "packed_seq_params_from_doc_ids",
    "pad",
    "physical_varlen_metadata",
    "resolve_packing_contract",
    "shard_cp_batch",
    "shard_packed_batch",
    "split_batch_metadata",
    "to_flash_attention_kwargs",
    "unpad",
    "varlen_metadata",
]

# NOTE [Compile caches do not see decompositions] (packfn/_cache.py)
install_cache_key_tag()
