"""Every workaround in packfn/_compat.py is still needed by a supported torch, and still works.

Each test runs the naive form of a workaround on the installed torch: it
must fail exactly on the releases the workaround names (else the
workaround is stale, or the releases it names are wrong), and the
workaround itself must work. ``test_each_workaround_is_needed_by_a_supported_release``
fails once packfn's lowest supported torch (pyproject.toml) no longer
needs one, so it gets removed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import torch
import torch.distributed._functional_collectives as fc
from torch._subclasses.fake_tensor import FakeTensorMode

import packfn.nemo_automodel as nemo
from packfn import _compat
from packfn.nemo_automodel import layout as dropin_layout

RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

# The torch releases (major, minor) on which each workaround's naive form fails.
NEEDED_ON = {
    "all_gather": {(2, 11), (2, 12)},
    "sym_min": {(2, 11)},
    "leading_columns": {(2, 13), (2, 14), (2, 15)},
}


def _supported_minimum() -> tuple[int, int]:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (torch_requirement,) = [r for r in pyproject["project"]["dependencies"] if r.startswith("torch")]
    major, minor = re.search(r">=\s*(\d+)\.(\d+)", torch_requirement).groups()
    return int(major), int(minor)


@pytest.mark.parametrize("name", sorted(NEEDED_ON))
def test_each_workaround_is_needed_by_a_supported_release(name):
    assert max(NEEDED_ON[name]) >= _supported_minimum(), (
        f"no supported torch (>= {_supported_minimum()}) needs the {name} workaround: remove it from packfn/_compat.py"
    )


def _fails(function) -> bool:
    """Whether ``function`` raises, compiled afresh: the compile caches key on the graph that calls
    packfn's ops, not on a monkeypatched decomposition (NOTE [Compile caches do not see decompositions])."""
    torch._dynamo.reset()
    try:
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            function()
    except Exception:
        return True
    finally:
        torch._dynamo.reset()
    return False


def test_all_gather_uses_the_current_name():
    renamed = hasattr(fc, "all_gather_single")
    assert renamed == (RELEASE not in NEEDED_ON["all_gather"])
    assert _compat.all_gather is (fc.all_gather_single if renamed else fc.all_gather_tensor)
    assert _compat.all_gather_autograd is (fc.all_gather_single_autograd if renamed else fc.all_gather_tensor_autograd)


def test_sym_min_of_ints_graph_breaks_only_where_named():
    explicit = torch.compile(lambda x, n: x * torch.sym_min(n, 3), fullgraph=True, backend="eager")
    assert _fails(lambda: explicit(torch.ones(2), 5)) == (RELEASE in NEEDED_ON["sym_min"])
    guarded = torch.compile(lambda x, n: x * _compat.sym_min(n, 3) + _compat.sym_max(n, 1), fullgraph=True)
    assert torch.equal(guarded(torch.ones(2), 5), torch.full((2,), 8.0))
    assert _compat.sym_min(4, 3) == 3 and _compat.sym_max(4, 3) == 4


def _compiled_layout_backward() -> None:
    def step(values, seq_lens):
        layout = nemo.packed_layout(seq_lens, seq_lens_padded=None, input_shape=tuple(values.shape[:2]), alignment=4)
        return layout.restore(layout.pack(values) * 2).sum()

    values = torch.randn(3, 16, 8, requires_grad=True)
    seq_lens = torch.tensor([[3, 5, 0], [7, 2, 1], [16, 0, 0]])
    torch.compile(step, fullgraph=True)(values, seq_lens).backward()
    real = torch.arange(16) < seq_lens.sum(1, keepdim=True)  # the documents are back to back
    assert torch.equal(values.grad, 2.0 * real[..., None].expand_as(values))


def test_sliced_unbacked_columns_break_the_backward_only_where_named(monkeypatch):
    assert not _fails(_compiled_layout_backward)
    monkeypatch.setattr(dropin_layout, "leading_columns", lambda tensor, count: tensor[:, :count])
    assert _fails(_compiled_layout_backward) == (RELEASE in NEEDED_ON["leading_columns"])


def test_private_apis_still_answer():
    assert _compat.current_dispatch_mode() is None
    with FakeTensorMode() as mode:
        assert _compat.current_dispatch_mode() is mode
    plain = torch.ones(3)
    assert not _compat.is_functorch_wrapper(plain)
    seen = []
    torch.func.vmap(lambda row: seen.append(_compat.is_functorch_wrapper(row)) or row)(torch.ones(2, 3))
    torch.func.functionalize(lambda x: seen.append(_compat.is_functorch_wrapper(x)) or x)(plain)
    assert seen == [True, True]
    assert issubclass(_compat.AsyncCollectiveTensor, torch.Tensor)
