"""packfn: packed-sequence metadata as torch.library ops that compile, export and never sync.

The top-level names are the sync-free core: every output shape is a
function of input shapes and static arguments, nothing reads a value back
to the host, and a compiled graph never specializes on a batch's contents.

- metadata (:mod:`packfn.metadata`): ``varlen_metadata``, ``batch_metadata``, ``flatten_metadata``;
- layouts (:mod:`packfn.layout`): ``aligned_layout``, ``safe_budget``, ``PackedSequenceLayout``;
- masks (:mod:`packfn.masks`): ``block_causal_mask``, ``document_mask_mod``, ``document_block_mask``;
- varlen inputs (:mod:`packfn.varlen`): ``physical_varlen_metadata``, ``unpad``, ``pad``;
- formats (:mod:`packfn.formats`): ``packed_position_ids``, ``document_ids_from_*`` (position ids, EOS,
  ``cu_seqlens``, ``seq_lens``, ``seq_idx``), ``seq_idx_from_document_ids``, ``seq_lens_from_document_ids``,
  ``thd_metadata``;
- attention backends (:mod:`packfn.attention`): the registry ``ATTENTION_BACKENDS`` (a backend's name to the
  ``AttentionInputKind`` it consumes) and ``attention_inputs``, a backend's inputs;
- the data side (:mod:`packfn.data`, host Python for loader workers): the packer ``pack_documents``,
  ``pack_stream``, ``suggest_budgets``, and the loader ``PackedDataset``;
- distributed (:mod:`packfn.distributed`): ``shard_packed_batch`` (load-balanced or contiguous), the
  local-query inputs of a rank and its attention work.

Integrations stand on the core: :mod:`packfn.integrations.hf` (transformers),
:mod:`packfn.integrations.megatron` (Megatron-core), :mod:`packfn.integrations.torchtune`. The NeMo
AutoModel drop-ins, which read the host once, are :mod:`packfn.nemo_automodel`.
The ops themselves are ``torch.ops.packfn.*`` (:mod:`packfn._ops`).
"""

import packfn._ops  # noqa: F401  (registers every op)
from packfn._cache import cache_key_tag, install_cache_key_tag
from packfn.attention import ATTENTION_BACKENDS, AttentionInputKind, attention_inputs
from packfn.data import (
    BudgetSuggestion,
    PackedBatch,
    PackedDataset,
    Piece,
    Pieces,
    pack_documents,
    pack_stream,
    suggest_budgets,
)
from packfn.distributed import (
    CPShard,
    CPVarlenMetadata,
    cp_attention_work,
    cp_block_causal_mask,
    cp_document_block_mask,
    cp_varlen_metadata,
    shard_packed_batch,
    split_batch_metadata,
)
from packfn.formats import (
    EosDocuments,
    ThdMetadata,
    document_ids_from_cu_seqlens,
    document_ids_from_eos,
    document_ids_from_position_ids,
    document_ids_from_seq_idx,
    document_ids_from_seq_lens,
    packed_position_ids,
    seq_idx_from_document_ids,
    seq_lens_from_document_ids,
    thd_metadata,
)
from packfn.layout import PackedSequenceLayout, aligned_layout, safe_budget
from packfn.masks import block_causal_mask, document_block_mask, document_mask_mod
from packfn.metadata import BatchMetadata, VarlenMetadata, batch_metadata, flatten_metadata, varlen_metadata
from packfn.varlen import PhysicalVarlenMetadata, pad, physical_varlen_metadata, unpad

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionInputKind",
    "BatchMetadata",
    "BudgetSuggestion",
    "CPShard",
    "CPVarlenMetadata",
    "EosDocuments",
    "PackedBatch",
    "PackedDataset",
    "PackedSequenceLayout",
    "PhysicalVarlenMetadata",
    "Piece",
    "Pieces",
    "ThdMetadata",
    "VarlenMetadata",
    "aligned_layout",
    "attention_inputs",
    "batch_metadata",
    "block_causal_mask",
    "cache_key_tag",
    "cp_attention_work",
    "cp_block_causal_mask",
    "cp_document_block_mask",
    "cp_varlen_metadata",
    "document_block_mask",
    "document_ids_from_cu_seqlens",
    "document_ids_from_eos",
    "document_ids_from_position_ids",
    "document_ids_from_seq_idx",
    "document_ids_from_seq_lens",
    "document_mask_mod",
    "flatten_metadata",
    "pack_documents",
    "pack_stream",
    "packed_position_ids",
    "pad",
    "physical_varlen_metadata",
    "safe_budget",
    "seq_idx_from_document_ids",
    "seq_lens_from_document_ids",
    "shard_packed_batch",
    "split_batch_metadata",
    "suggest_budgets",
    "thd_metadata",
    "unpad",
    "varlen_metadata",
]

# NOTE [Compile caches do not see decompositions] (packfn/_cache.py)
install_cache_key_tag()
