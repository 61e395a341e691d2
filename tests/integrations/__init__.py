"""Tests of the integrations that stand on the core (:mod:`packfn.hf`, scripts/hf_train.py)."""
