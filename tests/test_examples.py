"""The README's first example and every script in examples/ run as written (tiny sizes); the example model is exact."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# The examples a user runs (``python examples/<name>.py``); the others are imported (the package, the example model).
RUNNABLE = [path for path in sorted(EXAMPLES.glob("*.py")) if 'if __name__ == "__main__":' in path.read_text()]


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
    for page in [*(ROOT / "docs").glob("*.md"), *(path for path in EXAMPLES.glob("*.py") if path.stem != "__init__")]:
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
    assert {path.stem for path in EXAMPLES.glob("*.py")} - {path.stem for path in RUNNABLE} == {
        "__init__",
        "packed_decoder",  # the example model: the scripts train it, test_packed_decoder_* below checks it
    }
    source = Path(__file__).read_text()
    for script in RUNNABLE:
        assert f'"{script.stem}"' in source or f"{script.name}" in source, f"no test runs examples/{script.name}"


def test_packer_to_model_example_feeds_a_compiled_model_from_two_workers(capsys):
    argv = ["--batch", "2", "--sequence", "32", "--batches", "2", "--workers", "2"]
    assert _load(EXAMPLES / "packer_to_model.py").main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("packed == each document alone") == 2
    assert "suggest_budgets: max_documents=" in printed


def test_packed_decoder_on_packed_rows_equals_each_document_alone():
    """The example model's logits at a packed document's tokens are those of the document run alone in a row."""
    import torch

    from examples.packed_decoder import DecoderConfig, PackedDecoder

    config = DecoderConfig(sequence=24, max_documents=4, vocab=32, hidden=16, layers=2, heads=2, alignment=4)
    torch.manual_seed(0)
    model = PackedDecoder(config).eval()
    rows = [[5, 9, 3], [11, 7]]  # each row's document lengths, then padding
    input_ids = torch.randint(1, config.vocab, (len(rows), config.sequence))
    document_ids = torch.zeros(len(rows), config.sequence, dtype=torch.int64)
    for row, lengths in enumerate(rows):
        document_ids[row, : sum(lengths)] = torch.repeat_interleave(
            torch.arange(1, len(lengths) + 1), torch.tensor(lengths)
        )
    with torch.no_grad():
        packed = model(input_ids, document_ids)
        for row, lengths in enumerate(rows):
            start = 0
            for length in lengths:
                alone_ids = torch.zeros(1, config.sequence, dtype=torch.int64)
                alone_ids[0, :length] = input_ids[row, start : start + length]
                alone_documents = torch.zeros(1, config.sequence, dtype=torch.int64)
                alone_documents[0, :length] = 1
                alone = model(alone_ids, alone_documents)
                torch.testing.assert_close(packed[row, start : start + length], alone[0, :length])
                start += length
