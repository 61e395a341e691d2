"""End-to-end runs of ``scripts/hf_train.py`` at tiny sizes: a transformers Llama fed three ways, under torch.compile.

The script is called in-process through its ``main(argv)`` and its printed
report is parsed; timings are never checked.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

from scripts import hf_train

TINY = ["--batch", "2", "--sequence", "64", "--mean", "16", "--hidden", "32", "--heads", "2", "--layers", "1"]
TINY_RUN = [*TINY, "--vocab", "64", "--steps", "3", "--rounds", "0"]
HEADER = "== packfn hf_train report =="


def _run(argv: list[str]) -> tuple[int, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = hf_train.main(argv)
    return code, printed.getvalue()


@pytest.fixture(scope="module", params=["sdpa"])
def run(request) -> tuple[str, int, str]:
    """``(attn, exit code, report)`` of one tiny run per attention implementation."""
    code, printed = _run([*TINY_RUN, "--attn", request.param])
    assert HEADER in printed, printed[-2000:]
    return request.param, code, printed[printed.index(HEADER) :]


def _row(report: str, way: str) -> list[str]:
    """The cells of a way's row: graph breaks, recompiles, compile, median step, tokens/s, first loss."""
    line = next(line for line in report.splitlines() if line.startswith(way))
    return line[len(way) :].split()


def _cpu_flex_trains() -> bool:
    from torch.nn.attention.flex_attention import flex_attention

    query = torch.zeros(1, 1, 16, 16, requires_grad=True)
    try:
        flex_attention(query, query, query).sum().backward()
    except NotImplementedError:
        return False
    return True


def test_hf_train_exits_zero_with_the_three_ways_reported(run):
    attn, code, report = run
    assert code == 0, report
    assert f"attn_implementation={attn}" in report
    for way in hf_train.WAYS:
        cells = _row(report, way)
        assert len(cells) == 8, cells  # breaks, recompiles, compile "s", median "ms", tokens/s, loss
        assert float(cells[-1]) > 0


def test_packfn_way_compiles_once_with_no_graph_break(run):
    _, _, report = run
    graph_breaks, recompiles = _row(report, hf_train.PACKFN)[:2]
    assert (graph_breaks, recompiles) == ("0", "0"), report
    # Three steps over batches of one shape and different contents: one compile, then cache hits.
    assert f"{hf_train.PACKFN}: fullgraph=True: compiled once, the other 2 steps" in report


def test_first_step_losses_of_the_three_ways_agree(run):
    _, _, report = run
    line = next(line for line in report.splitlines() if line.startswith("loss agreement:"))
    match = re.fullmatch(
        r"loss agreement: first-step losses ([\d.]+) / ([\d.]+) / ([\d.]+): max \|diff\| (\S+) \(tolerance 1e-04\): OK",
        line,
    )
    assert match, line
    losses = [float(value) for value in match.groups()[:3]]
    assert max(losses) - min(losses) <= 1e-4, losses
    assert float(match.group(4)) <= 1e-4
    # The rows carry the same first-step losses as the agreement line.
    assert [float(_row(report, way)[-1]) for way in hf_train.WAYS] == pytest.approx(losses, abs=1e-6)


def test_the_mode_line_says_whether_the_steps_train(run):
    """The sdpa run trains; a flex run where FlexAttention has no backward (the CPU) says it runs forward only.

    The flex run is built by hand from the reason :func:`hf_train.flex_backward_error` gives on this machine:
    a compiled run of the three ways under flex costs minutes on the CPU, and only this line differs.
    """
    _, _, report = run
    mode = next(line for line in report.splitlines() if line.startswith("mode:"))
    assert mode.startswith("mode:         training: forward, backward and AdamW")
    reason = hf_train.flex_backward_error(torch.device("cpu"))
    assert (reason is None) == _cpu_flex_trains()
    if reason is not None:
        arguments = hf_train.parse_args([*TINY_RUN, "--attn", "flex_attention"])
        ways = {}
        for name in hf_train.WAYS:
            way = hf_train.Way(name, torch.nn.Linear(1, 1), hf_train.padded_loss, torch.device("cpu"), train=False)
            way.seconds, way.losses, way.tokens = [1.0, 0.5, 0.5], [4.0, 3.9, 3.8], [10, 10, 10]
            ways[name] = way
        flex = hf_train.HFTrainReport(arguments, ways, 2, 8, 30, 3, reason, 1e-4, 0.0)
        mode = next(line for line in flex.lines() if line.startswith("mode:"))
        assert "FORWARD ONLY (no backward, no optimizer)" in mode and reason in mode


def test_bad_attention_flag_exits_with_argparse_error(capsys):
    with pytest.raises(SystemExit) as raised:
        hf_train.main(["--attn", "nope"])
    assert raised.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_hf_train_exits_one_when_first_step_losses_differ(monkeypatch, capsys):
    """The exit code follows the agreement check (the report of a run whose losses differ, built by hand)."""
    arguments = hf_train.parse_args([*TINY_RUN, "--tolerance", "1e-4"])
    device = torch.device("cpu")
    ways = {}
    for index, name in enumerate(hf_train.WAYS):
        way = hf_train.Way(name, torch.nn.Linear(1, 1), hf_train.padded_loss, device, train=True)
        way.seconds, way.losses, way.tokens = [1.0, 0.5, 0.5], [4.0 + index * 1e-3, 3.9, 3.8], [10, 10, 10]
        ways[name] = way
    report = hf_train.HFTrainReport(arguments, ways, 2, 8, 30, 3, None, 1e-4, 0.0)
    monkeypatch.setattr(hf_train, "run", lambda arguments: report)
    assert hf_train.main(TINY_RUN) == 1
    captured = capsys.readouterr()
    assert "MISMATCH" in captured.out
    assert "first-step losses differ by 2.00e-03" in captured.err
