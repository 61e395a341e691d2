"""NeMo AutoModel's packing contracts (``datasets.packing`` 0.7.0): the types, the default, and their resolution.

A contract says which packed attention-mask representation a model consumes
(``packed_mask_type``) and whether it also consumes packed-sequence metadata.
Each mask type is also a backend name of packfn's registry
(:data:`packfn.ATTENTION_BACKENDS`), which is how
:func:`packfn.nemo_automodel.packed_attention_inputs` builds its inputs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Final, Literal, Protocol

__all__ = [
    "DEFAULT_PACKED_SEQUENCE_CONTRACT",
    "PackedMaskType",
    "PackedSequenceContract",
    "resolve_packing_contract",
]

PackedMaskType = Literal["block_causal", "document_ids", "flash_varlen"]
"""The packed attention-mask representation a model consumes.

- ``"block_causal"``: a ``[batch, 1, sequence, sequence]`` bool mask.
- ``"document_ids"``: the document-id mask itself.
- ``"flash_varlen"``: physical varlen boundaries for flash attention.
"""


class PackedSequenceContract(Protocol):
    """What a model needs from the collater of packed batches."""

    @property
    def packed_mask_type(self) -> PackedMaskType:
        """The packed attention-mask representation the model consumes."""
        ...

    @property
    def requires_packed_sequence_metadata(self) -> bool:
        """Whether the model consumes token indices and cumulative lengths."""
        ...


@dataclass(frozen=True)
class _DefaultPackedSequenceContract:
    """The contract used when the model states none: block-causal masks, no metadata."""

    packed_mask_type: PackedMaskType = "block_causal"
    requires_packed_sequence_metadata: bool = False


DEFAULT_PACKED_SEQUENCE_CONTRACT: Final[PackedSequenceContract] = _DefaultPackedSequenceContract()
_LEGACY_FLASH_ATTENTION_IMPLEMENTATIONS = frozenset({"flash_attention_2", "flash_attention_3", "flash_attention_4"})

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
