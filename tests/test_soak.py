"""A short run of bench/soak.py: the example app behind ProfilingMiddleware
(pct=1.0, calls=True) under real HTTP load with a unique X-Request-ID per
request.  Asserts no transport error and no non-2xx response, exactly one
profile per request the server saw (none lost, none doubled, none for an
unknown id), and bounded RSS growth after warm-up (generous: this is a
smoke version of the 200,000-request soak recorded in
docs/reliability.md, not a measurement)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SOAK = os.path.join(ROOT, "bench", "soak.py")


def run_soak(tmp_path, client, requests=3000):
    out = tmp_path / ("soak-%s.json" % client)
    proc = subprocess.run(
        [sys.executable, SOAK, "--requests", str(requests), "--client",
         client, "--max-growth-mb", "30", "--phase-timeout", "90",
         "--json", str(out)],
        capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert out.exists(), "no report:\n%s\n%s" % (proc.stdout[-3000:],
                                                  proc.stderr[-3000:])
    report = json.loads(out.read_text())
    return proc, report


def check(proc, report, requests):
    t = report["totals"]
    detail = "%s\n%s" % (proc.stdout[-3000:], proc.stderr[-3000:])
    assert sum(t["transport_errors"].values()) == 0, detail
    assert t["non2xx"] == 0, detail
    assert t["received"] >= requests, detail
    assert t["sent"] >= t["seen_by_server"] >= t["received"], detail
    # Exactly one profile per request the server saw.
    assert t["lost"] == 0 and t["doubled"] == 0, detail
    assert t["profiles_for_unseen"] == 0, detail
    assert t["profiles_delivered"] == t["seen_by_server"], detail
    assert t["skipped_full"] == 0 and t["greqprof_errors"] == 0, detail
    server = report["server"]
    assert server["open"] == 0 and server["no_rid"] == 0, detail
    for phase in ("warmup", "middle", "end"):
        ph = server["per_phase"][phase]
        assert ph["seen"] == ph["profiled"] > 0, (phase, ph)
    # Memory: bounded growth after warm-up (generous limit).
    assert t["rss_growth_after_warmup_kb"] < 30 * 1024, report["rss_kb"]
    # greqprof's own bookkeeping is back to empty.
    assert server["engine"]["lingering"] == 0
    assert server["engine"]["profile_requests"] == 0
    assert report["ok"] and proc.returncode == 0, detail


@pytest.mark.skipif(shutil.which("wrk") is None,
                    reason="wrk is not installed (Debian package wrk)")
def test_soak_wrk(tmp_path):
    proc, report = run_soak(tmp_path, "wrk")
    assert report["client"] == "wrk"
    check(proc, report, 3000)


def test_soak_python_client(tmp_path):
    proc, report = run_soak(tmp_path, "python", requests=1500)
    assert report["client"] == "python"
    check(proc, report, 1500)
