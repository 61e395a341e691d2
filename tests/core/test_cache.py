"""packfn's tag on torch.compile's caches (NOTE [Compile caches do not see decompositions]).

The main test is end to end: two processes share one Inductor cache
directory, the second imports a packfn whose op body differs, and must get
the result of its own body, not a cache hit compiled from the first one's.
A control run, with packfn's tag cleared in both processes, must get the
stale hit: it shows the test would fail without the protection.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import packfn
from packfn._cache import cache_key_tag, install_cache_key_tag, source_digest

PACKAGE = Path(packfn.__file__).resolve().parent

# One op body edit that changes the compiled result: the ``num_tokens``
# output of ``packfn::varlen_metadata`` becomes off by one. The public
# ``packfn.varlen_metadata`` (whose code Dynamo traces) is untouched, so
# the graph Dynamo hands to AOTAutograd is the same for both copies.
OP_FILE = Path("_ops", "metadata.py")
OP_BODY = "seqlens.max(), valid.sum(), num_documents, parsed.broken"
OP_BODY_EDITED = "seqlens.max(), valid.sum() + 1, num_documents, parsed.broken"

# Runs in a child process with one copy of packfn first on PYTHONPATH.
CHILD = """
import json, os, sys
import torch
import packfn
from torch._dynamo.utils import counters

if os.environ["PACKFN_TEST_CLEAR_TAG"] == "1":
    torch.compiler.config.cache_key_tag = ""
mask = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])

def num_tokens(mask):
    return packfn.varlen_metadata(mask, max_documents=2).num_tokens

compiled = torch.compile(num_tokens, fullgraph=True)(mask)
print(json.dumps({
    "file": packfn.__file__,
    "tag": torch.compiler.config.cache_key_tag,
    "compiled": int(compiled),
    "eager": int(num_tokens(mask)),
    "counters": {name: dict(counters[name]) for name in ("aot_autograd", "inductor")},
}))
"""


def _copy_package(destination: Path, *, edit: bool) -> Path:
    """A copy of the packfn package under ``destination``; with ``edit``, one op body changed."""
    copy = destination / "packfn"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    if edit:
        source = copy / OP_FILE
        text = source.read_text()
        assert text.count(OP_BODY) == 1, f"the edit no longer applies to {source}"
        source.write_text(text.replace(OP_BODY, OP_BODY_EDITED))
    return copy


def _start(copy: Path, cache: Path, *, clear_tag: bool, user_tag: str) -> subprocess.Popen[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE_")) and key != "PYTHONPATH"
    }
    env.update(
        PYTHONPATH=str(copy.parent),  # ahead of the installed packfn
        TORCHINDUCTOR_CACHE_DIR=str(cache),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
        TORCH_COMPILE_CACHE_KEY_TAG=user_tag,
        PACKFN_TEST_CLEAR_TAG="1" if clear_tag else "0",
        # Speed only, the same in every run: no C++ vector-ISA probe builds
        # (seconds per fresh cache directory) and no compile worker pool.
        TORCHINDUCTOR_VEC_ISA_OK="0",
        TORCHINDUCTOR_COMPILE_THREADS="1",
    )
    return subprocess.Popen(
        [sys.executable, "-c", CHILD],
        cwd=cache.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str], copy: Path) -> dict:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-4000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve() == copy / "__init__.py", result["file"]
    return result


def test_compile_cache_sees_op_body_changes(tmp_path):
    old = _copy_package(tmp_path / "old", edit=False)
    new = _copy_package(tmp_path / "new", edit=True)
    assert source_digest(old) != source_digest(new)

    # Two cache directories, each filled by the old copy then read by the
    # new one: "tagged" as shipped (with a user tag set before the import,
    # which must survive), "control" with packfn's tag cleared. The two
    # pairs are independent and run side by side.
    runs = {
        "tagged": dict(clear_tag=False, user_tag="user-tag"),
        "control": dict(clear_tag=True, user_tag=""),
    }
    first = {name: _start(old, tmp_path / f"cache-{name}", **options) for name, options in runs.items()}
    first = {name: _finish(process, old) for name, process in first.items()}
    second = {name: _start(new, tmp_path / f"cache-{name}", **options) for name, options in runs.items()}
    second = {name: _finish(process, new) for name, process in second.items()}

    # The mask holds 9 tokens; the edited body says 10.
    assert first["tagged"]["compiled"] == first["tagged"]["eager"] == 9, first["tagged"]
    assert first["control"]["compiled"] == first["control"]["eager"] == 9, first["control"]
    assert first["tagged"]["tag"] == f"user-tag+{source_digest(old)}"
    assert second["tagged"]["tag"] == f"user-tag+{source_digest(new)}"
    assert first["control"]["tag"] == second["control"]["tag"] == ""

    # Protected: the new copy compiles its own body.
    assert second["tagged"]["eager"] == 10, second["tagged"]
    assert second["tagged"]["compiled"] == 10, second["tagged"]

    # Control: the same cache traffic without packfn's tag serves the old
    # body from the warm cache. If this stops failing over, torch's cache
    # keys now see custom-op decompositions and the tag is redundant.
    assert second["control"]["eager"] == 10, second["control"]
    assert second["control"]["compiled"] == 9, (
        "without packfn's tag the warm cache no longer serves the old op body",
        second["control"],
    )


def test_tag_digests_every_source_file(tmp_path):
    copy = tmp_path / "packfn"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    tag = source_digest(copy)
    assert tag.startswith("packfn-") and len(tag) == len("packfn-") + 16
    int(tag.removeprefix("packfn-"), 16)
    assert tag == source_digest(PACKAGE) == cache_key_tag()

    # One byte of one op body (in a subpackage).
    source = copy / OP_FILE
    original = source.read_bytes()
    source.write_bytes(original.replace(b"num_tokens", b"num_tokenz", 1))
    assert source_digest(copy) != tag
    source.write_bytes(original)
    assert source_digest(copy) == tag

    # A new file, and a rename, count too; bytecode caches do not.
    (copy / "_new.py").write_text("")
    assert source_digest(copy) != tag
    (copy / "_new.py").unlink()
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "__pycache__" / "stray.pyc").write_bytes(b"\0")
    assert source_digest(copy) == tag
    (copy / "_checks.py").rename(copy / "_checks2.py")
    assert source_digest(copy) != tag


def test_install_appends_to_the_user_tag_once():
    tag = cache_key_tag()
    # Installed by ``import packfn``.
    assert tag in torch.compiler.config.cache_key_tag

    with torch.compiler.config.patch(cache_key_tag="mine"):
        assert install_cache_key_tag() == f"mine+{tag}"
        assert install_cache_key_tag() == f"mine+{tag}"
        importlib.reload(packfn)
        assert torch.compiler.config.cache_key_tag == f"mine+{tag}"

    with torch.compiler.config.patch(cache_key_tag=""):
        assert install_cache_key_tag() == tag
        assert install_cache_key_tag() == tag

    # A user who sets a tag after the import keeps packfn's by including it.
    with torch.compiler.config.patch(cache_key_tag=f"{tag}:mine"):
        assert install_cache_key_tag() == f"{tag}:mine"
        assert packfn.cache_key_tag() == tag
