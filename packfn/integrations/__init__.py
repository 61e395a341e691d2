"""packfn inside other frameworks, each standing on the core and nothing else.

- :mod:`packfn.integrations.hf`: transformers (a model's packed inputs in one call, the model patched in place
  by ``apply_packfn``, the collator);
- :mod:`packfn.integrations.trainer`: transformers' ``Trainer`` and TRL's ``SFTTrainer`` on a ``PackedDataset``
  (the loader's state in every checkpoint, an exact resume, packing stats in the logs);
- :mod:`packfn.integrations.megatron`: Megatron-core (static THD ``PackedSeqParams``, its ltor masks);
- :mod:`packfn.integrations.torchtune`: torchtune (its packed collate, with document ids).

Each imports its framework only where it needs it, so importing packfn never imports them.
"""
