"""NeMo AutoModel's packing contracts (``datasets.packing`` 0.7.0), ``resolve_packing_contract`` included.

The contract types live in :mod:`packfn.contract` (the core takes them);
this module adds upstream's resolution of the deprecated
``attn_implementation`` keyword, with its ``FutureWarning`` rules.
"""

from __future__ import annotations

import warnings

from packfn.contract import (
    DEFAULT_PACKED_SEQUENCE_CONTRACT,
    FLASH_ATTENTION_IMPLEMENTATIONS,
    PackedMaskType,
    PackedSequenceContract,
    _DefaultPackedSequenceContract,
)

__all__ = [
    "DEFAULT_PACKED_SEQUENCE_CONTRACT",
    "PackedMaskType",
    "PackedSequenceContract",
    "resolve_packing_contract",
]

_LEGACY_FLASH_ATTENTION_IMPLEMENTATIONS = frozenset(FLASH_ATTENTION_IMPLEMENTATIONS)

_DEPRECATED_FOR_DEFAULT = (
    "attn_implementation is deprecated for packed-sequence construction; "
    "pass the model-derived packing contract instead"
)
_IGNORED_FOR_EXPLICIT = (
    "attn_implementation is deprecated and ignored because an explicit packing contract was supplied"
)


def resolve_packing_contract(
    packing: PackedSequenceContract,
    attn_implementation: str | None,
) -> PackedSequenceContract:
    """Resolve the deprecated ``attn_implementation`` keyword into a contract.

    Args:
        packing: The contract the caller passed; an explicit one always wins.
        attn_implementation: Deprecated attention backend name, or ``None``.

    Returns:
        ``packing`` itself when ``attn_implementation`` is ``None`` (no
        warning) or when ``packing`` is an explicit contract (a
        ``FutureWarning`` says the keyword is ignored). When ``packing`` is
        :data:`DEFAULT_PACKED_SEQUENCE_CONTRACT`, a new default-type contract
        whose mask type is ``"flash_varlen"`` for the legacy flash-attention
        names and ``"block_causal"`` for any other name, with a
        ``FutureWarning``.
    """
    if attn_implementation is None:
        return packing
    if packing is DEFAULT_PACKED_SEQUENCE_CONTRACT:
        legacy_flash = attn_implementation in _LEGACY_FLASH_ATTENTION_IMPLEMENTATIONS
        mask_type: PackedMaskType = "flash_varlen" if legacy_flash else "block_causal"
        packing = _DefaultPackedSequenceContract(packed_mask_type=mask_type)
        message = _DEPRECATED_FOR_DEFAULT
    else:
        message = _IGNORED_FOR_EXPLICIT
    # stacklevel 3: the warning points at whoever called the caller, as upstream's does.
    warnings.warn(message, FutureWarning, stacklevel=3)
    return packing
