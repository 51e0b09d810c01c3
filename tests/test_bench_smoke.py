"""The benchmark scripts run end to end (--quick): they measure nothing
here (timings are never asserted in tests), but they must keep working and
their recorded-event checks must hold."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", ["switch_overhead.py", "call_overhead.py"])
def test_benchmark_script_runs(script):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", script), "--quick"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "greqprof" in out
    # The scripts verify that greqprof recorded every timed event.
    checks = [line for line in out.splitlines() if "check:" in line]
    assert checks, out[-2000:]
    for line in checks:
        assert "MISMATCH" not in line.upper(), line


@pytest.mark.skipif(shutil.which("wrk") is None,
                    reason="wrk (Debian package) is not installed")
def test_load_benchmark_runs():
    """bench/load_overhead.py --quick: real servers side by side under wrk;
    the greqprof row must have sampled requests and no internal error."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "load_overhead.py"),
         "--quick", "--only", "gqp-5pct,passthrough", "--json",
         os.devnull],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "INVALID" not in out and "SKIPPED" not in proc.stderr, \
        out[-2000:] + proc.stderr[-2000:]
    row = [ln for ln in out.splitlines()
           if ln.startswith("greqprof pct=0.05")]
    assert len(row) == 1, out[-2000:]
    # "<sampled> / <requests>": the middleware really sampled under load
    sampled, requests = [int(x) for x in
                         re.search(r"(\d+) / (\d+)", row[0]).groups()]
    assert 0 < sampled < requests
