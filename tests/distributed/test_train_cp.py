"""scripts/train_cp.py end to end: torchrun, four gloo ranks as a 2 x 2 (data x context parallel) mesh."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_cp.py"


def test_dp_times_balanced_cp_trains_as_one_process_compiled_without_recompiles(tmp_path):
    # --check trains a copy on the whole rows of every data-parallel rank's batches in each process and
    # fails unless every step's loss and the final weights match; --compile (aot_eager: Dynamo and
    # AOTAutograd, no C++ build) with error_on_recompile after the first batch.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    command += [str(SCRIPT), "--dp", "2", "--cp", "2", "--steps", "3", "--sequence", "64", "--mean", "24"]
    command += ["--layers", "1", "--hidden", "32", "--examples", "60", "--dtype", "float64", "--check"]
    command += ["--compile", "--backend", "aot_eager"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=environment)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "check: losses and weights equal to the single-process run" in done.stdout
    assert len(re.findall(r"^step \d: loss \d+\.\d+$", done.stdout, re.MULTILINE)) == 3
    # Every context-parallel rank of a data-parallel group attends the same work, within 5%.
    balance = re.search(r"balance='rotated': attention work max / mean over cp ranks = (\d\.\d+)", done.stdout)
    assert balance and float(balance.group(1)) <= 1.05, done.stdout
    assert re.search(r"^ +3 +1 +1 +[\d,]+ +[\d,]+ +\d+\.\d$", done.stdout, re.MULTILINE), done.stdout
