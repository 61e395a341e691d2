"""examples/packer_to_model.py runs as written (at tiny sizes) and checks itself: packed == each document alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "packer_to_model.py"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_packer_to_model_example_feeds_a_compiled_model_from_two_workers(capsys):
    assert _load(EXAMPLE).main(["--batch", "2", "--sequence", "32", "--batches", "2", "--workers", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("packed == each document alone") == 2
    assert "suggest_budgets: max_documents=" in printed
