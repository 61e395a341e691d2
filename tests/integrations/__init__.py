"""Tests of the integrations that stand on the core (:mod:`packfn.integrations.hf`, scripts/hf_train.py)."""

SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=128,
)
"""The tiny model sizes the integration tests build their transformers models at (random weights)."""
