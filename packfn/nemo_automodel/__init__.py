"""NeMo AutoModel 0.7.0's packing helpers, exactly: same names, signatures, outputs, Python types and errors.

Each reads the host once in eager (where upstream's output has a
data-dependent size, or upstream returns a Python ``int``): the static op of
the core (:mod:`packfn`) followed by one trim, an unbacked size under
``torch.compile`` / ``torch.export``, never a graph break. On CPU tensors in
eager, where no device waits, the metadata drop-ins work at exact sizes from
the start (NOTE [Exact sizes on the CPU] in :mod:`.metadata`). Use the core
where shapes must stay static (compiled forwards, CUDA graphs), or, for the
collater's keys of a contract, ``packed_attention_inputs(..., static=True)``.

====================================================  ==========================================
upstream (``nemo_automodel.components...``)          here
====================================================  ==========================================
``datasets.packing`` contracts                        ``PackedMaskType``, ``PackedSequenceContract``,
                                                      ``DEFAULT_PACKED_SEQUENCE_CONTRACT``,
                                                      ``resolve_packing_contract``
``datasets.packing`` metadata                         ``PackedSequenceMetadata``, ``get_seqlens_in_batch``,
                                                      ``get_unpad_data``, ``build_packed_sequence_metadata``
``models.common.packing``                             ``flatten_packed_sequence_metadata``
``models.deepseek_v41.packing``                       ``PackedSequenceLayout``, ``packed_layout``
``models.deepseek_v41.cp``                            ``ShardLayout``, ``shard_cp_batch``, ``gather_sequence``
``datasets.packed_seq``                               ``PackedSeqParams``, ``packed_seq_params_from_doc_ids``,
                                                      ``to_flash_attention_kwargs``
``datasets.utils.neat_packed_collater`` (packed keys)  ``packed_attention_inputs``
====================================================  ==========================================
"""

import packfn  # noqa: F401  (registers the core ops)
from packfn.nemo_automodel.collater import packed_attention_inputs
from packfn.nemo_automodel.contract import (
    DEFAULT_PACKED_SEQUENCE_CONTRACT,
    PackedMaskType,
    PackedSequenceContract,
    resolve_packing_contract,
)
from packfn.nemo_automodel.cp import ShardLayout, gather_sequence, shard_cp_batch
from packfn.nemo_automodel.layout import PackedSequenceLayout, packed_layout
from packfn.nemo_automodel.metadata import (
    PackedSequenceMetadata,
    build_packed_sequence_metadata,
    flatten_packed_sequence_metadata,
    get_seqlens_in_batch,
    get_unpad_data,
)
from packfn.nemo_automodel.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids, to_flash_attention_kwargs

__all__ = [
    "DEFAULT_PACKED_SEQUENCE_CONTRACT",
    "PackedMaskType",
    "PackedSeqParams",
    "PackedSequenceContract",
    "PackedSequenceLayout",
    "PackedSequenceMetadata",
    "ShardLayout",
    "build_packed_sequence_metadata",
    "flatten_packed_sequence_metadata",
    "gather_sequence",
    "get_seqlens_in_batch",
    "get_unpad_data",
    "packed_attention_inputs",
    "packed_layout",
    "packed_seq_params_from_doc_ids",
    "resolve_packing_contract",
    "shard_cp_batch",
    "to_flash_attention_kwargs",
]
