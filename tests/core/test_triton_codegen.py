"""Every public function's Triton code for an H200, written on the CPU (no GPU in CI).

Inductor decides in its Triton code generation what fails on a GPU and what
a GPU launches: a split scan torch 2.11 cannot write (NOTE [Scans that
never split] in ``packfn/_ops/scan.py``), a search Triton cannot tile (NOTE
[One flat search] in ``packfn/_ops/metadata.py``). :mod:`scripts.inductor_cuda`
runs that generation for a CUDA device on this machine, so these tests fail
in CI where the GPU would, on every torch release CI runs.

The sizes are where Inductor changes path: a scan past 8192 columns over
fewer than 2 x 132 rows splits (8193 columns of eight rows, every
function; with dynamic shapes, the functions that are not shards: a
shard's are the same ops, and its dynamic compile is the slowest of all).
One row takes the same split path as eight. ``scripts/gpu_check.py`` runs them all on a GPU at every
size.
"""

from __future__ import annotations

import logging

import pytest
import torch

from scripts.benchmarks.common import make_inputs
from scripts.catalog import catalog
from scripts.inductor_cuda import triton_code

# (batch, sequence, dynamic): eight rows and one past the split, and a dynamic compile past it.
SIZES = [(8, 8193, False), (8, 8193, True)]


def _entries(batch: int, sequence: int, mean: int = 300) -> dict:
    # Rank 1 of 2: its queries start inside the row. Its masks and varlen inputs each build the shard again.
    entries = catalog(make_inputs(sequence, mean, batch=batch, hidden=4), ranks=(1,))
    return {
        name: entry
        for name, entry in entries.items()
        if entry.compiles and not name.startswith(("shard_packed_batch", "cp_attention_work"))
    }


CASES = [
    pytest.param(name, batch, sequence, dynamic, id=f"{name}-{batch}x{sequence}{'-dynamic' * dynamic}")
    for name, entry in sorted(_entries(1, 64, mean=8).items())
    for batch, sequence, dynamic in SIZES
    if (batch == 8 and not dynamic) or entry.layer != "distributed"
]


@pytest.fixture(scope="module")
def entries_by_size():
    return {(batch, sequence): _entries(batch, sequence) for batch, sequence, _ in SIZES}


@pytest.fixture(autouse=True)
def _quiet_inductor():
    # A failed Triton generation logs the whole IR node at CRITICAL before it raises; the exception is the report.
    logging.getLogger("torch._inductor").disabled = True
    yield
    logging.getLogger("torch._inductor").disabled = False


@pytest.mark.parametrize(("name", "batch", "sequence", "dynamic"), CASES)
def test_public_function_writes_triton_code_past_the_split_scan_length(entries_by_size, name, batch, sequence, dynamic):
    entry = entries_by_size[(batch, sequence)][name]
    code = triton_code(entry.function, *entry.args, dynamic=dynamic)
    assert "torch.ops.packfn" not in code and "packfn::" not in code, f"{name} calls back into a packfn op"
    assert "@triton.jit" in code or name == "attention_inputs[document_ids]", f"{name} wrote no Triton kernel"


def test_codegen_reproduces_the_split_scan_failure_on_the_releases_that_have_it():
    """The tool sees what an H200 saw: a row-wise running sum with a row-indexed load, split past 8192 columns."""

    def row_sums_plus_row_offset(values, offsets):
        return (values + offsets[:, None]).cumsum(1)

    args = (torch.ones(8, 8193, dtype=torch.int64), torch.arange(8))
    if torch.__version__ < (2, 13):  # pytorch/pytorch#180221, fixed by #180369 in 2.13
        with pytest.raises(TypeError, match="list indices must be integers or slices, not NoneType"):
            triton_code(row_sums_plus_row_offset, *args)
    else:
        assert "triton_spl_" in triton_code(row_sums_plus_row_offset, *args)  # the split scan, written
    assert "triton_spl_" not in triton_code(row_sums_plus_row_offset, args[0][:, :8192], args[1])  # not split
