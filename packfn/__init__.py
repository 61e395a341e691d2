"""packfn: packed-sequence metadata as compilable, exportable torch.library ops."""

from packfn.contract import (
    DEFAULT_PACKED_SEQUENCE_CONTRACT,
    PackedMaskType,
    PackedSequenceContract,
    resolve_packing_contract,
)
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

__all__ = [
    "DEFAULT_PACKED_SEQUENCE_CONTRACT",
    "BatchMetadata",
    "PackedMaskType",
    "PackedSequenceContract",
    "PackedSequenceMetadata",
    "VarlenMetadata",
    "batch_metadata",
    "build_packed_sequence_metadata",
    "flatten_metadata",
    "flatten_packed_sequence_metadata",
    "get_seqlens_in_batch",
    "get_unpad_data",
    "resolve_packing_contract",
    "varlen_metadata",
]
