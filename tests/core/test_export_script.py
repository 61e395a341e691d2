"""``scripts/export.py`` end to end at a tiny size: ``torch.export``, the decompositions and an AOTInductor package.

Apart from the other script runs (tests/scripts/), which CI runs on its default torch release only: what
export and AOTInductor accept changes from one release to the next, so this one runs on every release.
"""

from __future__ import annotations

from scripts import export

TINY_MODEL = ["--batch", "2", "--sequence", "64", "--mean", "16", "--hidden", "32", "--heads", "2", "--layers", "1"]


def test_export_round_trip_through_decompositions_and_aoti_package(tmp_path):
    report = export.run(export.parse_args([*TINY_MODEL, "--vocab", "64", "--batches", "2", "--out", str(tmp_path)]))
    assert report.ok
    assert {"packfn.batch_metadata.default", "packfn.aligned_layout.default"} <= set(report.exported_packfn_nodes)
    assert not report.decomposed_packfn_nodes
    assert (tmp_path / "packed_decoder.pt2").is_file()
    assert len(report.aoti_max_errors) == 2
