"""The bench's formats family at a tiny size: every case runs, with host reads counted for its eager variants."""

from __future__ import annotations

import json


def test_formats_family_rows_and_counts(tmp_path):
    from scripts import bench

    json_path = tmp_path / "formats.json"
    argv = ["--sequences", "64", "--means", "16", "--repeats", "1", "--sample-ms", "1", "--families", "formats"]
    assert bench.main([*argv, "--json", str(json_path), "--plot", str(tmp_path / "formats.png")]) == 0
    rows = json.loads(json_path.read_text())["rows"]
    cases = {row["case"] for row in rows}
    assert {"packed_position_ids", "position ids to document ids", "seq_lens to document ids"} <= cases
    for row in rows:
        if row["variant"].startswith("packfn eager"):  # the static path, counted through its decompositions
            assert row["host_reads"] == 0 and row["data_dependent_ops"] == 0, row
