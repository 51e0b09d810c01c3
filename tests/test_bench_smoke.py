"""The benchmark scripts run end to end (--quick): they measure nothing
here (timings are never asserted in tests), but they must keep working and
their recorded-event checks must hold."""
import os
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
