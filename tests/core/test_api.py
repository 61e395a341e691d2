"""The public API by layer: the core's names, the drop-ins' names, and the import graph between the layers."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import packfn
import packfn.nemo_automodel

CORE_NAMES = {
    "ATTENTION_BACKENDS",
    "AttentionInputKind",
    "BatchMetadata",
    "BudgetSuggestion",
    "CPShard",
    "CPVarlenMetadata",
    "EosDocuments",
    "PackedBatch",
    "PackedDataset",
    "PackedSequenceLayout",
    "PhysicalVarlenMetadata",
    "Piece",
    "Pieces",
    "ThdMetadata",
    "VarlenMetadata",
    "aligned_layout",
    "attention_inputs",
    "batch_metadata",
    "block_causal_mask",
    "cache_key_tag",
    "cp_attention_work",
    "cp_block_causal_mask",
    "cp_document_block_mask",
    "cp_varlen_metadata",
    "document_block_mask",
    "document_ids_from_cu_seqlens",
    "document_ids_from_eos",
    "document_ids_from_position_ids",
    "document_ids_from_seq_idx",
    "document_ids_from_seq_lens",
    "document_mask_mod",
    "flatten_metadata",
    "pack_documents",
    "pack_stream",
    "packed_position_ids",
    "pad",
    "physical_varlen_metadata",
    "safe_budget",
    "seq_idx_from_document_ids",
    "seq_lens_from_document_ids",
    "shard_packed_batch",
    "split_batch_metadata",
    "suggest_budgets",
    "thd_metadata",
    "unpad",
    "varlen_metadata",
}

DROP_IN_NAMES = {
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
}


# ------------------------------------------------------------------ the layers


def test_top_level_all_is_exactly_the_core():
    assert set(packfn.__all__) == CORE_NAMES
    assert len(packfn.__all__) == len(CORE_NAMES)  # no name twice
    for name in packfn.__all__:
        assert getattr(packfn, name) is not None, name


def test_nemo_automodel_all_is_exactly_the_drop_ins():
    assert set(packfn.nemo_automodel.__all__) == DROP_IN_NAMES
    for name in packfn.nemo_automodel.__all__:
        assert getattr(packfn.nemo_automodel, name) is not None, name


def test_the_contract_types_are_the_drop_ins():
    """NeMo's contract types are upstream's words: the drop-in layer has them, the core speaks backends."""
    for name in ("DEFAULT_PACKED_SEQUENCE_CONTRACT", "PackedMaskType", "PackedSequenceContract"):
        assert not hasattr(packfn, name), name
        assert getattr(packfn.nemo_automodel, name) is not None, name
    assert packfn.nemo_automodel.PackedSequenceLayout is packfn.PackedSequenceLayout


def test_import_packfn_does_not_import_the_drop_ins():
    """The core never imports the drop-in layer: checked in a fresh interpreter (this one has imported both)."""
    code = (
        "import sys\n"
        "import packfn\n"
        "assert 'packfn.nemo_automodel' not in sys.modules\n"
        "import packfn.distributed, packfn.data, packfn.integrations.hf\n"
        "leaked = sorted(name for name in sys.modules if name.startswith('packfn.nemo_automodel'))\n"
        "assert not leaked, leaked\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


# ------------------------------------------------------------ the import graph

PACKAGE = Path(packfn.__file__).parent
OUTER_LAYERS = ("packfn.integrations", "packfn.nemo_automodel")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """``(module, name)`` of every packfn import in a file: ``name`` is None for ``import module``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.startswith("packfn")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("packfn"):
            found += [(node.module, alias.name) for alias in node.names]
    return found


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _in(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_private_name_of_another(module):
    """A module uses another's public names only (a private module such as ``packfn._ops`` is fine)."""
    private = [
        f"{source}.{name}"
        for source, name in _imports(MODULES[module])
        if name is not None and name.startswith("_") and source != module
    ]
    assert not private, f"{module} imports private names: {private}"


@pytest.mark.parametrize(
    "module", sorted(name for name in MODULES if not any(_in(name, layer) for layer in OUTER_LAYERS))
)
def test_the_core_and_the_data_side_import_no_integration_and_no_drop_in(module):
    outward = [
        source
        for source, name in _imports(MODULES[module])
        for target in (source if name is None else f"{source}.{name}",)
        if any(_in(target, layer) for layer in OUTER_LAYERS)
    ]
    assert not outward, f"{module} imports {outward}"


@pytest.mark.parametrize("module", sorted(name for name in MODULES if _in(name, "packfn.integrations")))
def test_the_integrations_import_no_drop_in(module):
    outward = [source for source, _ in _imports(MODULES[module]) if _in(source, "packfn.nemo_automodel")]
    assert not outward, f"{module} imports {outward}"


def test_one_function_per_public_name_across_the_package():
    """A public name means one thing: no two modules define different objects under one ``__all__`` name."""
    seen: dict[str, tuple[str, object]] = {}
    clashes = []
    for module in sorted(MODULES):
        imported = importlib.import_module(module)
        for name in getattr(imported, "__all__", ()):
            value = getattr(imported, name)
            if isinstance(value, (str, int, float, tuple, frozenset)):
                continue
            if name in seen and seen[name][1] is not value:
                clashes.append(f"{name}: {seen[name][0]} and {module}")
            seen.setdefault(name, (module, value))
    assert not clashes, clashes
