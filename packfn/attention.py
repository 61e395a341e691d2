"""Deprecated module: its names moved to :mod:`packfn.masks`, :mod:`packfn.varlen`, :mod:`packfn.formats`,
:mod:`packfn.contract` and (the NeMo AutoModel drop-ins) :mod:`packfn.nemo_automodel`."""

from packfn._deprecated import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "block_causal_mask": "packfn.masks:block_causal_mask",
        "document_block_mask": "packfn.masks:document_block_mask",
        "document_mask_mod": "packfn.masks:document_mask_mod",
        "PhysicalVarlenMetadata": "packfn.varlen:PhysicalVarlenMetadata",
        "physical_varlen_metadata": "packfn.varlen:physical_varlen_metadata",
        "pad": "packfn.varlen:pad",
        "unpad": "packfn.varlen:unpad",
        "packed_position_ids": "packfn.formats:packed_position_ids",
        "packed_attention_inputs": "packfn.contract:packed_attention_inputs",
        "PackedSeqParams": "packfn.nemo_automodel:PackedSeqParams",
        "packed_seq_params_from_doc_ids": "packfn.nemo_automodel:packed_seq_params_from_doc_ids",
        "to_flash_attention_kwargs": "packfn.nemo_automodel:to_flash_attention_kwargs",
    },
)
