"""The README's first example and every script in examples/ run as written (at tiny sizes)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_example_runs_as_pasted():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README.md has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme_example"})


def test_readme_links_every_example_and_docs_page():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(((?:docs|examples|profiles)/[^)#]*)", readme):
        assert (ROOT / target).exists(), target
    for page in [*(ROOT / "docs").glob("*.md"), *EXAMPLES.glob("*.py")]:
        assert f"]({page.relative_to(ROOT).as_posix()}" in readme, f"README does not link {page.relative_to(ROOT)}"


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("varlen_forward", ["--batch", "2", "--sequence", "32", "--batches", "2"]),
        ("transformers_one_call", ["--sequence", "32", "--steps", "2"]),
    ],
)
def test_example_runs_and_checks_itself(name, argv, capsys):
    assert _load(EXAMPLES / f"{name}.py").main(argv) == 0
    assert "each document alone" in capsys.readouterr().out


def test_context_parallel_example_runs_on_two_processes():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "context_parallel.py")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "2 ranks: the sharded attention equals one process" in done.stdout


def test_every_example_is_run_by_a_test():
    source = Path(__file__).read_text()
    for script in EXAMPLES.glob("*.py"):
        assert f'"{script.stem}"' in source or f"{script.name}" in source, f"no test runs examples/{script.name}"


def test_packer_to_model_example_feeds_a_compiled_model_from_two_workers(capsys):
    argv = ["--batch", "2", "--sequence", "32", "--batches", "2", "--workers", "2"]
    assert _load(EXAMPLES / "packer_to_model.py").main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("packed == each document alone") == 2
    assert "suggest_budgets: max_documents=" in printed
