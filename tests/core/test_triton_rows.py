"""The Triton kernels of the mask-parsing ops (NOTE [Two launches on a GPU]), checked on the CPU.

CI has no GPU. The kernels run through Triton's interpreter against the
aten bodies in ``tests/core/triton_rows_interpreted.py``, which this file
runs in a pytest of its own (the interpreter must be on before Triton is
imported); here, what AOTAutograd traces on a GPU tensor and what Inductor
writes for an H200 (``scripts/inductor_cuda.py``): the kernels, and each public function's launches.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import packfn
from packfn._ops import _registry
from packfn._ops import formats as format_ops
from packfn._ops import metadata as ops
from packfn._ops import varlen as varlen_ops
from packfn.layout import worst_case_budget

from scripts.benchmarks.common import make_inputs
from scripts.catalog import catalog
from scripts.inductor_cuda import kernel_names, triton_code
from tests.strategies import random_mask
from tests.strategies_formats import PackedRows
from tests.strategies_layout import layout_fields

PHYSICAL = varlen_ops.physical_varlen_metadata_op
ROOT = Path(__file__).parents[2]


def test_kernels_in_the_interpreter_match_the_aten_bodies():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/core/triton_rows_interpreted.py"]
    result = subprocess.run(
        command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=1200, check=False
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def test_cpu_tensors_take_the_aten_bodies():
    mask = torch.ones(2, 4, dtype=torch.int64)
    assert not _registry.gpu_kernels(mask)
    assert not _registry.gpu_kernels(torch.empty(0, 4, device="meta").to("meta"))


class _Traced(Exception):
    pass


def _batch_major(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flatten_metadata's inputs, from the aten body (a CPU tensor's)."""
    parsed = ops.batch_metadata_op.math(mask, 64)
    return parsed.packed_token_indices, parsed.cu_seqlens


# Each op's arguments from a mask, its kernels (two; one for position ids), and its rule flags' reductions (three for
# the mask ops, four for flatten's, five for THD's and the writes of their stack and cat; position ids: two, and
# their stack's write).
LAUNCHES = {
    ops.varlen_metadata_op: (lambda mask: (mask, 64), ["_row_stats_0", "_varlen_rows_1"], 3),
    ops.batch_metadata_op: (lambda mask: (mask, 64), ["_row_stats_0", "_batch_rows_1"], 3),
    ops.flatten_metadata_op: (_batch_major, ["_flatten_stats_0", "_flatten_rows_1"], 4),
    format_ops.thd_metadata_op: (lambda mask: (mask, 64), ["_row_stats_0", "_thd_rows_1"], 7),
    PHYSICAL: (lambda mask: (mask,), ["_segment_stats_0", "_segment_rows_1"], 0),
    format_ops.position_ids_op: (lambda mask: (mask,), ["_position_rows_0"], 3),
}


@pytest.mark.parametrize("op", sorted(LAUNCHES, key=lambda op: op.__name__), ids=lambda op: op.__name__)
def test_the_decomposition_launches_its_kernels(op):
    """What AOTAutograd traces on a GPU tensor: the kernels, no packfn op; Inductor writes them and the flags."""
    graphs = []

    def backend(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(graph, inputs):
            graphs.append(str(graph.graph))
            raise _Traced

        return aot_module_simplified(gm, example_inputs, fw_compiler=record)

    arguments, kernels, flags = LAUNCHES[op]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *args: tuple(op(*args)), backend=backend, fullgraph=True)
    with (
        mock.patch.object(_registry, "gpu_kernels", lambda tensor: True),
        pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="_Traced"),
    ):
        compiled(*arguments(random_mask(2, 16, seed=3)))  # traced, never run: no GPU, and no interpreter here
    torch._dynamo.reset()
    launched = graphs[0].count("target=torch.ops.higher_order.triton_kernel_wrapper_functional]")
    assert launched == len(kernels) and "packfn" not in graphs[0]
    # Inductor's code for an H200 launches those two, and the flags' reductions: no memset, no copy.
    names = kernel_names(triton_code(lambda *args: tuple(op(*args)), *arguments(random_mask(8, 32768, seed=4))))
    others = [name for name in names if name not in kernels]
    assert [name for name in names if name in kernels] == kernels
    assert len(names) == len(set(names)) == len(kernels) + flags
    assert all(
        name.startswith(("triton_per_fused_any_", "triton_poi_fused_stack", "triton_poi_fused_cat")) for name in others
    ), others


def _tables(block_mask) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(block_mask, f"{full}{side}_{kind}") for full in ("", "full_") for side in ("kv", "q")
                 for kind in ("num_blocks", "indices"))  # fmt: skip


def _varlen(indices: torch.Tensor, num_tokens: torch.Tensor) -> packfn.VarlenMetadata:
    """What ``pad`` reads of a batch's metadata (the rest is never read)."""
    return packfn.VarlenMetadata(indices, *[None] * 3, num_tokens, None, indices.numel() // 8)


def _unpadded(metadata: packfn.VarlenMetadata) -> tuple[torch.Tensor, ...]:
    """``pad``'s inputs: the permutation, the valid tokens and bf16 activations in varlen order, 8 rows."""
    values = torch.randn(8, metadata.max_seqlen_bound, 64).to(torch.bfloat16)
    return metadata.indices, metadata.num_tokens, packfn.unpad(values, metadata)


# What a user calls, as Inductor writes it for an H200: the kernels, then one kernel of the flags' reductions fused
# with their asserts (assert_rules reads the flags as the bits of one integer), and batch_metadata's maximum over the
# rows. SPEC section 6 allows 4.
# ASSERTS stands for that kernel: a persistent reduction of the flags with their asserts.
ASSERTS = "triton_per_fused_*_assert_async_any_*"
LAYOUT_ASSERTS = "triton_per_fused_*_assert_async_*_max_*"


def _layout(seq_lens: torch.Tensor) -> packfn.PackedSequenceLayout:
    """The layout of 8 rows of 32768 columns, documents aligned to 64, at the budget any such row fits."""
    return packfn.aligned_layout(
        seq_lens, sequence_length=32768, alignment=64, budget=worst_case_budget(32768, 128, 64, 0)
    )


PUBLIC = {
    "varlen_metadata": (
        lambda m: tuple(packfn.varlen_metadata(m, max_documents=64)),
        ["_row_stats_0", "_varlen_rows_1", ASSERTS],
    ),
    "batch_metadata": (
        lambda m: tuple(packfn.batch_metadata(m, max_documents=64)),
        [
            "_row_stats_0",
            ASSERTS,
            "_batch_rows_1",
            "triton_per_fused_max_1",
        ],
    ),
    "physical_varlen_metadata": (
        lambda m: tuple(packfn.physical_varlen_metadata(m)),
        ["_segment_stats_0", "_segment_rows_1"],
    ),
    "flatten_metadata": (
        lambda indices, cu_seqlens: tuple(packfn.flatten_metadata(indices, cu_seqlens)),
        [
            "_flatten_stats_0",
            "_flatten_rows_1",
            ASSERTS,
            "triton_per_fused_max_slice_sub_1",
        ],
    ),
    "packed_position_ids": (
        packfn.packed_position_ids,
        ["_position_rows_0", ASSERTS],
    ),
    "document_block_mask": (
        lambda m: _tables(packfn.document_block_mask(m)),
        ["triton_per_fused_*_all_amax_amin_any_*", "_block_tables_0", "_row_stats_1", ASSERTS],
    ),
    "thd_metadata": (
        lambda m: tuple(packfn.thd_metadata(m, max_documents=64)),
        ["_row_stats_0", "_thd_rows_1", ASSERTS],
    ),
    "document_ids_from_seq_lens": (
        lambda seq_lens: packfn.document_ids_from_seq_lens(seq_lens, 32768),
        ["_length_rows_0", ASSERTS],
    ),
    "document_ids_from_cu_seqlens": (
        lambda cu_seqlens: packfn.document_ids_from_cu_seqlens(cu_seqlens, 32768),
        ["_boundary_rows_0", ASSERTS],
    ),
    "document_ids_from_cu_seqlens[flat]": (
        lambda cu_seqlens, valid: packfn.document_ids_from_cu_seqlens(cu_seqlens, 32768, batch=8, attention_mask=valid),
        ["_boundary_rows_0", ASSERTS],
    ),
    "document_ids_from_position_ids": (
        lambda positions, valid: packfn.document_ids_from_position_ids(positions, attention_mask=valid),
        ["_position_id_rows_0", ASSERTS],
    ),
    "document_ids_from_eos": (
        lambda tokens: tuple(packfn.document_ids_from_eos(tokens, [1, 2], pad_token_id=0, vocab_size=50000)),
        ["_eos_rows_0", ASSERTS],
    ),
    # On the metadata a step parses once, in bf16 activations: pad's one kernel and its rule's reduction (of a flag
    # per 32 positions: a looped reduction, with the assert).
    "pad": (
        lambda indices, num_tokens, values: packfn.pad(values, _varlen(indices, num_tokens)),
        ["_pad_rows_0", "triton_red_fused_*_assert_async_any_*"],
    ),
    # The layout's one kernel, then its rules' reduction with their asserts (the rows' first broken document by a
    # maximum, and the longest row); pack and restore add their gather.
    "aligned_layout": (
        lambda seq_lens: layout_fields(_layout(seq_lens)),
        ["_layout_rows_0", LAYOUT_ASSERTS],
    ),
    "pack": (
        lambda seq_lens, values: _layout(seq_lens).pack(values),
        ["_layout_rows_0", LAYOUT_ASSERTS, "triton_poi_fused_*_gather_*"],
    ),
    "restore": (
        lambda seq_lens, packed: _layout(seq_lens).restore(packed),
        ["_layout_rows_0", LAYOUT_ASSERTS, "triton_poi_fused_*_gather_*"],
    ),
}
# Each conversion's inputs, from the packed rows' mask (by the aten bodies, on the CPU).
INPUTS = {
    "flatten_metadata": _batch_major,
    "document_ids_from_seq_lens": lambda mask: (packfn.seq_lens_from_document_ids(mask, max_documents=128),),
    "document_ids_from_cu_seqlens": lambda mask: (packfn.batch_metadata(mask, max_documents=128).cu_seqlens,),
    "document_ids_from_cu_seqlens[flat]": lambda mask: (packfn.physical_varlen_metadata(mask).cu_seqlens, mask > 0),
    "document_ids_from_position_ids": lambda mask: (packfn.packed_position_ids(mask), mask > 0),
    "document_ids_from_eos": lambda mask: (mask,),  # the ids as tokens: ids 1 and 2 end documents, 0 pads
    "pad": lambda mask: _unpadded(packfn.varlen_metadata(mask)),
    "aligned_layout": lambda mask: (packfn.seq_lens_from_document_ids(mask, max_documents=128),),
    "pack": lambda mask: (packfn.seq_lens_from_document_ids(mask, max_documents=128), torch.randn(8, 32768, 16)),
    "restore": lambda mask: (
        packfn.seq_lens_from_document_ids(mask, max_documents=128),
        torch.randn(8, worst_case_budget(32768, 128, 64, 0), 16),
    ),
}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        if "assuming every input is mutated" in record.getMessage():  # torch's words when it cannot read a kernel
            self.messages.append(record.getMessage())


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_public_functions_launch_their_kernels(name):
    """And torch read every kernel's Triton IR: a kernel Triton's compiler refuses (the interpreter runs it) makes
    torch log a warning, assume every argument written and clone the mask."""
    function, expected = PUBLIC[name]
    records = _Records()
    logger = logging.getLogger("torch._dynamo")  # where torch.library's Triton support logs
    logger.addHandler(records)
    try:
        torch._dynamo.reset()
        mask = PackedRows(32768, ((300,) * 100,) * 8).document_ids
        arguments = INPUTS.get(name, lambda mask: (mask,))(mask)
        names = kernel_names(triton_code(function, *arguments))
        torch._dynamo.reset()
    finally:
        logger.removeHandler(records)
    assert not records.messages, records.messages[0]
    assert len(names) == len(expected) <= 4
    assert all(fnmatch.fnmatchcase(name, pattern) for name, pattern in zip(names, expected, strict=True)), names


# The public functions that take a mask (or a padding mask, for the position ids' conversion), and a bool one.
BOOL_INPUTS = {
    "varlen_metadata": lambda mask: (mask > 0,),
    "batch_metadata": lambda mask: (mask > 0,),
    "physical_varlen_metadata": lambda mask: (mask > 0,),
    "packed_position_ids": lambda mask: (mask > 0,),
    "thd_metadata": lambda mask: (mask > 0,),
    "document_block_mask": lambda mask: (mask > 0,),
    "document_ids_from_cu_seqlens[flat]": INPUTS["document_ids_from_cu_seqlens[flat]"],
    "document_ids_from_position_ids": INPUTS["document_ids_from_position_ids"],
    "document_ids_from_eos": lambda mask: (mask, mask > 0),
}


@pytest.mark.parametrize("name", sorted(BOOL_INPUTS))
def test_a_bool_mask_launches_the_same_kernels(name):
    """The kernels read a bool mask as it is: torch 2.11's Inductor could not lower the ``view(torch.uint8)`` that
    fed them one ("torch.bool is not supported by torch.iinfo"), so no bool mask compiled for CUDA there."""
    function, expected = PUBLIC[name]
    if name == "document_ids_from_eos":
        function = lambda tokens, valid: tuple(packfn.document_ids_from_eos(tokens, [1, 2], attention_mask=valid))  # noqa: E731
    torch._dynamo.reset()
    arguments = BOOL_INPUTS[name](PackedRows(32768, ((300,) * 100,) * 8).document_ids)
    assert any(argument.dtype == torch.bool for argument in arguments)
    names = kernel_names(triton_code(function, *arguments))
    torch._dynamo.reset()
    # The same kernels, in an order of Inductor's (document_block_mask's kernels move with the bool's cast).
    unmatched = list(names)
    for pattern in (re.sub(r"_\d+$", "_*", pattern) for pattern in expected):
        unmatched.remove(next((name for name in unmatched if fnmatch.fnmatchcase(name, pattern)), pattern))
    assert not unmatched and len(names) == len(expected), names


def test_the_block_causal_mask_checks_its_rules_in_one_pass():
    """``mask_flags`` on CUDA: ``_row_stats`` where the aten body parses the mask (a memset, a scan, a scatter,
    ...), then the flags with their asserts and the mask itself."""
    mask = PackedRows(4096, ((300,) * 13,) * 8).document_ids
    names = kernel_names(triton_code(packfn.block_causal_mask, mask))
    assert len(names) == 3 and names[0] == "_row_stats_0" and fnmatch.fnmatchcase(names[1], ASSERTS), names


def test_the_mask_is_not_counted_as_written():
    """torch follows a store's address back through the ops that make it, and through a call to all its
    arguments: a helper that loaded the mask would make the mask count as written, and Inductor would
    clone it where it is read again (as ``hf_model_inputs`` does), NOTE [Two launches on a GPU]."""
    entry = catalog(make_inputs(1024, 300, batch=8, hidden=4), ranks=(1,))["hf_model_inputs[flash_attention_2]"]
    kernels = kernel_names(triton_code(entry.function, *entry.args))
    assert "_segment_rows_1" in kernels and not [name for name in kernels if "copy" in name or "clone" in name]
