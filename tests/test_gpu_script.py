"""bench/gpu.sh, which waits for a GPU, works before one comes: its CPU mode runs the whole
script at a smoke size and prints every line of its report."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_script_runs_on_the_cpu_and_reports_every_figure():
    run = subprocess.run(["sh", "bench/gpu.sh", "--cpu"], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    report = run.stdout
    assert re.search(r"greedy \(float32\) equals generate for \d of 4 prompts; compiled equals eager for \d of 4", report), report
    assert re.search(r"generate, one request: +[\d.]+ tok/s", report), report
    assert re.search(r"compiled step ready in [\d.]+ s", report), report
    rate = r" +[\d.]+ tok/s = x +[\d.]+ of generate, x[\d.]+ of the bare loop"
    for size in (1, 4):
        assert re.search(rf"batch +{size}: engine{rate}; compiled{rate}", report), report
