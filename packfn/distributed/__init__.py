"""Distributed helpers for packed batches, with static shapes and no host read.

- :mod:`packfn.distributed.cp`: context parallelism (:func:`shard_packed_batch`,
  contiguous or load-balanced, and :func:`all_gather_sequence`);
- :mod:`packfn.distributed.balanced`: the per-document head-tail shards;
- :mod:`packfn.distributed.attention`: a rank's attention inputs (dense mask,
  FlexAttention ``BlockMask``, varlen boundaries) and its attention work;
- :mod:`packfn.distributed.microbatch`: :func:`split_batch_metadata`.

NeMo AutoModel's ``shard_cp_batch`` and its ``gather_sequence`` are in
:mod:`packfn.nemo_automodel`.
"""

from packfn.distributed.attention import (
    CPVarlenMetadata,
    cp_attention_work,
    cp_block_causal_mask,
    cp_document_block_mask,
    cp_varlen_metadata,
)
from packfn.distributed.cp import CPShard, all_gather_sequence, shard_packed_batch
from packfn.distributed.microbatch import split_batch_metadata

__all__ = [
    "CPShard",
    "CPVarlenMetadata",
    "all_gather_sequence",
    "cp_attention_work",
    "cp_block_causal_mask",
    "cp_document_block_mask",
    "cp_varlen_metadata",
    "shard_packed_batch",
    "split_batch_metadata",
]
