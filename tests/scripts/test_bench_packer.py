"""scripts/bench_packer.py at tiny sizes: every packer's fill and time, and a verdict for every target."""

from __future__ import annotations

import json

from scripts import bench_packer


def test_bench_packer_reports_every_target_and_writes_json(tmp_path, capsys):
    out = tmp_path / "packer.json"
    argv = ["--quick", "--documents", "400", "--rounds", "1", "--max-documents", "16", "--json", str(out)]
    assert bench_packer.main(argv) == 0
    printed = capsys.readouterr().out
    assert "alignment 1, no cap: packfn fill within 0.5 points of BFD" in printed
    assert "alignments 16, 128: packfn fill >= BFD on the aligned sizes with the same cap" in printed
    result = json.loads(out.read_text())
    assert len(result["fills"]) == 2 * 3 * 3 and len(result["times"]) == 2
    for entry in result["fills"]:  # sequence 4096: every alignment divides it, so BFD's problem is the packer's
        assert entry["lower_bound_rows"] <= entry["packfn_rows"] <= entry["bfd_rows"]


def test_bench_packer_times_the_loader_with_statistics_on_and_off(tmp_path, capsys):
    out = tmp_path / "loader.json"
    argv = ["--quick", "--parts", "loader", "--documents", "300", "--rounds", "1", "--json", str(out)]
    assert bench_packer.main(argv) == 0
    printed = capsys.readouterr().out
    assert "loader: packing statistics within 1.02x of the loader's CPU time without them on 2 streams" in printed
    result = json.loads(out.read_text())
    assert result["fills"] == [] and result["times"] == [] and len(result["loader"]) == 2
    for entry in result["loader"]:
        for clock in ("cpu", "wall"):
            assert entry[clock]["stats_on_s"] > 0 and entry[clock]["stats_off_s"] > 0
        assert entry["batches"] > 0 and entry["on_over_off"] == entry["cpu"]["on_over_off"]
        assert entry["packing_stats"]["real_tokens"] == sum(bench_packer.stream_lengths(entry["stream"], 4096, 300))
