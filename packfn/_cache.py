"""packfn's part of torch.compile's cache keys.

NOTE [Compile caches do not see decompositions]
torch.compile's artifact caches key on the graph Dynamo captured, and that
graph *calls* ``torch.ops.packfn.*``: it does not contain the Python bodies
that AOTAutograd inlines through each op's Python-dispatcher
``CompositeImplicitAutograd`` kernel (NOTE [One body, three roles] in
:mod:`packfn._ops._registry`). The AOTAutograd cache keys on exactly that
graph (custom-op nodes count as cacheable), so after packfn changes an op
body a warm cache (``TORCHINDUCTOR_CACHE_DIR``, by default shared by every
run of a user) serves code compiled from the old body: a silent wrong
answer, with no recompile and no warning. The FX graph cache alone would
notice, since Inductor receives the decomposed aten graph, but an
AOTAutograd hit loads its compiled graph by the FX key it stored, so the
decomposition is never looked at again. Both caches are on by default.
tests/core/test_cache.py reproduces the stale hit with two processes.

The knob torch provides for breaking these caches is
``torch.compiler.config.cache_key_tag``: it enters the FX graph cache key
(``FxGraphHashDetails``), the AOTAutograd cache key (whose details subclass
it), the autotune cache key and the PGO key. Importing packfn appends
:func:`cache_key_tag`, a digest of packfn's own sources, to whatever tag is
already set, so the caches break exactly when packfn's code changes. The
setting stays the user's: a tag set before the import is kept (packfn's is
appended), and a user who sets a tag afterwards replaces packfn's and can
put it back with ``f"{mine}+{packfn.cache_key_tag()}"``.

``torch.compiler.config.cache_key_tag`` exists, and enters both keys, in
torch 2.11.0 and 2.13.0 (read in their sources); 2.14.1 was not at hand,
but a recent main-branch source still has it, so there is no fallback. If a
release drops it, this module is the one place to handle that.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

__all__ = ["cache_key_tag", "install_cache_key_tag", "source_digest"]

_PACKAGE = Path(__file__).resolve().parent
_SEPARATOR = "+"


@functools.cache
def cache_key_tag() -> str:
    """``"packfn-<16 hex>"``: a digest of every ``.py`` file of the packfn package.

    Hashes each file's path relative to the package and its bytes, in path
    order, so any edit, addition, removal or rename changes the tag.
    Computed once per process: the tag names the sources this process
    imported, even if the files change on disk later. See NOTE [Compile
    caches do not see decompositions].
    """
    return source_digest(_PACKAGE)


def source_digest(package: Path) -> str:
    """``"packfn-<16 hex>"`` over the ``.py`` files under ``package`` (uncached)."""
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py"), key=lambda path: path.relative_to(package).as_posix()):
        relative = source.relative_to(package).as_posix().encode()
        data = source.read_bytes()
        # Each field prefixed by its length: no two file sets give one stream.
        digest.update(len(relative).to_bytes(8, "little") + relative)
        digest.update(len(data).to_bytes(8, "little") + data)
    return f"packfn-{digest.hexdigest()[:16]}"


def install_cache_key_tag() -> str:
    """Append :func:`cache_key_tag` to ``torch.compiler.config.cache_key_tag``; return the result.

    Idempotent: a tag that already holds packfn's is left as it is, so
    importing or reloading packfn twice appends once. Called by
    ``import packfn``.
    """
    config = torch.compiler.config
    tag = cache_key_tag()
    current = config.cache_key_tag
    if tag not in current:
        config.cache_key_tag = f"{current}{_SEPARATOR}{tag}" if current else tag
    return config.cache_key_tag
