"""The Triton kernels of the mask-parsing ops (NOTE [Two launches on a GPU]), run on the CPU.

CI has no GPU, so the kernels run through Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors, from a copy of
``packfn/_ops/triton_rows.py`` loaded with the interpreter on (the module
the ops import stays as it is). Small blocks and row groups make a short
row span several blocks and a small batch several groups, so every carry
from block to block and every sum over the rows before is exercised; one
test keeps the shipped sizes. ``tests/core/test_triton_codegen.py`` writes
the same kernels into Inductor's code for an H200.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import packfn
from packfn._ops import _registry
from packfn._ops import metadata as ops

from scripts.inductor_cuda import kernel_names, triton_code
from tests.assertions import assert_same, assert_same_outputs
from tests.core.test_eager_kernels import BROKEN
from tests.strategies import packing_masks, random_mask

GPU_OPS = [ops.varlen_metadata_op, ops.batch_metadata_op]
OUTPUTS = {ops.varlen_metadata_op: ops.VarlenOutputs, ops.batch_metadata_op: ops.BatchOutputs}
SOURCE = Path(_registry.__file__).with_name("triton_rows.py")


def _interpreter():
    return mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"})


def _interpreted(block: int, rows: int):
    """A copy of the module, its kernels made for the interpreter (which is on only while they run)."""
    with _interpreter():
        spec = importlib.util.spec_from_file_location(f"triton_rows_interpreted_{block}_{rows}", SOURCE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    module.BLOCK, module.ROWS = block, rows
    return module


@pytest.fixture(scope="module")
def small():
    """Blocks of 8 columns, groups of 2 rows."""
    return _interpreted(8, 2)


def _kernels(module, op):
    def run(*args):
        with _interpreter():
            return OUTPUTS[op](*getattr(module, op.__name__.removesuffix("_op"))(*args))

    return run


@pytest.mark.parametrize("op", GPU_OPS, ids=lambda op: op.__name__)
@settings(max_examples=60, deadline=None)
@given(mask=packing_masks(max_sequence=40, max_batch=5), capacity=st.sampled_from([1, 2, 5, 300, None]))
@example(mask=torch.tensor([[0, 0]]), capacity=None)
@example(mask=torch.tensor([[3, 0, 3, 5]], dtype=torch.uint8), capacity=2)
@example(mask=torch.tensor([[1] * 8 + [2] * 8 + [0] * 8 + [2, 3]]), capacity=None)  # a document across blocks
def test_kernels_match_the_decomposition(small, op, mask, capacity):
    assert_same_outputs(op, mask, capacity or mask.shape[1], body=_kernels(small, op))


@pytest.mark.parametrize("op", GPU_OPS, ids=lambda op: op.__name__)
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_kernels_report_the_same_first_broken_rule(small, op, name):
    mask = torch.tensor(BROKEN[name])
    assert_same_outputs(op, mask, 2, body=_kernels(small, op))
    assert _kernels(small, op)(mask, 2).broken.any()


@pytest.mark.parametrize("op", GPU_OPS, ids=lambda op: op.__name__)
def test_kernels_at_their_shipped_sizes(op):
    """1024 columns a block, 128 rows a group: rows of 2500 span three blocks, 130 rows two groups."""
    shipped = _interpreted(1024, 128)
    for mask in (random_mask(3, 2500, seed=0, documents=40), random_mask(130, 5, seed=1, documents=2)):
        assert_same_outputs(op, mask, mask.shape[1], body=_kernels(shipped, op))


def test_cpu_tensors_take_the_aten_bodies():
    mask = torch.ones(2, 4, dtype=torch.int64)
    assert not _registry.gpu_kernels(mask)
    assert not _registry.gpu_kernels(torch.empty(0, 4, device="meta").to("meta"))


@pytest.mark.parametrize("function", [packfn.varlen_metadata, packfn.batch_metadata], ids=lambda f: f.__name__)
def test_public_functions_take_the_kernels_on_a_gpu_tensor(small, function):
    """In eager the op's kernel launches the Triton kernels where ``gpu_kernels`` says (a CUDA tensor)."""
    mask = random_mask(3, 30, seed=2, documents=4)
    expected = function(mask, max_documents=6)
    with (
        _interpreter(),
        mock.patch.object(_registry, "gpu_kernels", lambda tensor: True),
        mock.patch.object(_registry, "_gpu_body", lambda name: getattr(small, name)),
        mock.patch.object(ops, "parse_mask_eager", None),  # the aten body would fail
    ):
        assert_same(tuple(function(mask, max_documents=6)), tuple(expected))


class _Traced(Exception):
    pass


@pytest.mark.parametrize("op", GPU_OPS, ids=lambda op: op.__name__)
def test_the_decomposition_launches_the_two_kernels(op):
    """What AOTAutograd traces on a GPU tensor: the two kernels, no packfn op; Inductor writes them alone."""
    graphs = []

    def backend(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(graph, inputs):
            graphs.append(str(graph.graph))
            raise _Traced

        return aot_module_simplified(gm, example_inputs, fw_compiler=record)

    mask = random_mask(2, 16, seed=3)
    torch._dynamo.reset()
    compiled = torch.compile(lambda m: tuple(op(m, 4)), backend=backend, fullgraph=True)
    with (
        mock.patch.object(_registry, "gpu_kernels", lambda tensor: True),
        pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="_Traced"),
    ):
        compiled(mask)  # traced, never run: the kernels cannot run on the CPU outside the interpreter
    torch._dynamo.reset()
    launched = graphs[0].count("target=torch.ops.higher_order.triton_kernel_wrapper_functional]")
    assert launched == 2 and "packfn" not in graphs[0]
    # Inductor's code for an H200 launches those two and nothing else (no memset, no copy).
    code = triton_code(lambda m: tuple(op(m, 64)), random_mask(8, 32768, seed=4))
    assert kernel_names(code) == ["_row_stats_0", f"_{op.__name__.removesuffix('_metadata_op')}_rows_1"]
