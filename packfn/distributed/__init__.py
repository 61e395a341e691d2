"""Distributed helpers for packed batches, with static shapes and no host read.

- :mod:`packfn.distributed.cp`: contiguous context parallelism
  (:func:`shard_packed_batch`, the local-query attention inputs of a rank,
  :func:`all_gather_sequence`).
- :mod:`packfn.distributed.microbatch`: :func:`split_batch_metadata`.

NeMo AutoModel's ``shard_cp_batch`` and its ``gather_sequence`` are in
:mod:`packfn.nemo_automodel`.
"""

from packfn.distributed.cp import (
    CPShard,
    CPVarlenMetadata,
    cp_block_causal_mask,
    cp_document_block_mask,
    cp_varlen_metadata,
    all_gather_sequence,
    shard_packed_batch,
)
from packfn.distributed.microbatch import split_batch_metadata

__all__ = [
    "CPShard",
    "CPVarlenMetadata",
    "cp_block_causal_mask",
    "cp_document_block_mask",
    "cp_varlen_metadata",
    "all_gather_sequence",
    "shard_packed_batch",
    "split_batch_metadata",
]
