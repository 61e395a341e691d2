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


def test_bench_corpus_measures_each_pipeline_on_one_saved_corpus(tmp_path, capsys):
    from scripts import bench_corpus

    out, corpus = tmp_path / "corpus.json", tmp_path / "corpus"
    sizes = ["--documents", "600", "--mean", "30", "--sequence", "256", "--batch", "2", "--window", "100"]
    # packfn in its own subprocess, as the full run measures every pipeline.
    assert bench_corpus.main([*sizes, "--corpus", str(corpus), "--pipelines", "packfn", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "packfn RSS within 2x a window's tokens" in printed
    result = json.loads(out.read_text())
    tokens = result["corpus"]["tokens"]
    assert result["corpus"]["settings"]["documents"] == 600
    packfn = result["results"]["packfn"]
    assert packfn["real_tokens"] == tokens and packfn["batches"] > 0
    assert 0 < packfn["first_batch_s"] <= packfn["seconds"]
    assert packfn["memory"]["peak"]["VmHWM"] >= packfn["memory"]["loaded"]["VmRSS"] > 0
    # TRL's pipeline in this process (its import is the slow part of a subprocess): the same tokens, its cache
    # file removed, and the report's two targets.
    arguments = bench_corpus.parse([*sizes, "--corpus", str(corpus)])
    trl = bench_corpus.run_trl(corpus, arguments)
    assert trl["real_tokens"] == tokens and trl["batches"] > 0
    assert not list(corpus.glob("cache-*.arrow"))
    verdicts = bench_corpus.targets({"packfn": packfn, "trl": trl}, arguments)
    assert verdicts[0].startswith("packfn at least 5x TRL + flattening in tokens/s: ")
    assert len(bench_corpus.rows({"packfn": packfn, "trl": trl}, arguments)) == 4
