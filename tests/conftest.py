"""Test session set-up shared by every module."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
from hypothesis import settings

# A test run compiles into a fresh Inductor cache, never one a user's
# earlier runs left: packfn tags its cache keys with its source digest
# (packfn/_cache.py), and tests/core/test_cache.py checks that tag against
# caches it fills itself. The process that starts pytest makes the folder;
# the xdist workers and the processes tests start inherit it (an environment
# variable, set before torch is imported), so a graph compiled by one is a
# cache hit for the others.
if "PACKFN_TEST_INDUCTOR_CACHE" not in os.environ:
    os.environ["PACKFN_TEST_INDUCTOR_CACHE"] = tempfile.mkdtemp(prefix="packfn-inductor-")
    atexit.register(shutil.rmtree, os.environ["PACKFN_TEST_INDUCTOR_CACHE"], ignore_errors=True)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["PACKFN_TEST_INDUCTOR_CACHE"]

# Hypothesis: every failure prints the blob that reproduces it
# (``@reproduce_failure(...)``), CI (which sets CI=true) draws the same
# examples on every run, and no deadline (the first call of an op compiles
# or warms caches). Loaded before any test module builds its ``settings(...)``,
# which inherit whatever they leave unspecified from this profile.
_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
settings.register_profile(
    "packfn",
    print_blob=True,
    deadline=None,
    derandomize=_CI,
    **({"database": None} if _CI else {}),  # a derandomized run has nothing to replay
)
settings.load_profile("packfn")


def pytest_runtest_setup(item):
    """Fail a Hypothesis test whose ``settings(...)`` lost the profile (built before it loaded, or overriding it)."""
    test_settings = getattr(getattr(item, "obj", None), "_hypothesis_internal_use_settings", None)
    if test_settings is None:
        return
    if not (test_settings.print_blob and test_settings.deadline is None and test_settings.derandomize == _CI):
        pytest.fail(
            "this Hypothesis test does not inherit the packfn profile of tests/conftest.py "
            f"(print_blob=True, deadline=None, derandomize={_CI}): {test_settings}",
            pytrace=False,
        )


@pytest.fixture
def no_graph_breaks():
    """Fail the test if torch.compile broke a graph during it."""
    from torch._dynamo.utils import counters  # not at the top: torch must see the cache folder set above

    counters.clear()
    yield
    assert not counters["graph_break"], dict(counters["graph_break"])
