"""Test session set-up shared by every module."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Compiled artifacts are cached by the graph that calls a packfn op, not by
# the op's decomposition: a cache left by an older checkout could hand these
# tests code compiled from old decompositions. Each test process compiles
# into a fresh cache of its own (set before torch is imported).
_CACHE = tempfile.mkdtemp(prefix="packfn-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# The strategy modules and scripts are imported as top-level names.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
