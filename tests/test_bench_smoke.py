"""The benchmark scripts run end to end (--quick): they measure nothing
here (timings are never asserted in tests), but they must keep working and
their recorded-event checks must hold."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import greqprof

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


@pytest.mark.skipif(shutil.which("callgrind_control") is None,
                    reason="valgrind (Debian package) is not installed")
def test_server_instructions_counts_a_real_server():
    """bench/server_instructions.py: a real server under callgrind, tiny
    load.  Instruction counts are deterministic enough to assert that
    profiling every request adds work, and that the top list names it."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "server_instructions.py"),
         "bare", "gqp-100pct", "--connections", "4", "--requests", "32",
         "--warmup", "16", "--top", "100"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:]
            for line in proc.stdout.splitlines()
            if line.startswith(("bare ", "gqp-100pct "))}
    assert int(rows["bare"][0]) > 0
    assert int(rows["gqp-100pct"][1]) > 0, proc.stdout
    # (the middleware's count of sampled requests while counted: every one
    # at pct=1.0, and what one of them added)
    assert rows["gqp-100pct"][4] == "32", proc.stdout
    assert int(rows["gqp-100pct"][5]) > 0, proc.stdout
    assert len(rows["bare"]) == 4, proc.stdout
    # A function of libgreqprof's among those that grew most.  (Which one
    # ranks highest depends on the interpreter: on 3.10 the app's own
    # Python costs more and pushes gqp_tracer_switch down the list.)
    assert re.search(r"^gqp_\w+\s+\+\d", proc.stdout, re.M), proc.stdout


@pytest.mark.skipif(shutil.which("wrk") is None,
                    reason="wrk (Debian package) is not installed")
def test_load_benchmark_ab_runs_a_checkout_beside_a_config(tmp_path):
    """bench/load_overhead.py --ab: B (a config of this tree) beside A (a
    config served from a checkout given by path, here this one)."""
    checkout = ROOT
    if os.path.dirname(os.path.abspath(greqprof.__file__)) != os.path.join(
            ROOT, "greqprof"):
        # Testing an installed greqprof: this tree's greqprof/, if any, is
        # not built, so A is a checkout of bench/ and examples/ alone and
        # both sides import the installed package.
        checkout = str(tmp_path / "checkout")
        for d in ("bench", "examples"):
            shutil.copytree(os.path.join(ROOT, d), os.path.join(checkout, d))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "load_overhead.py"),
         "--quick", "--ab", checkout + ":bare", 'gqp{"pct": 0.5}'],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "round 1: B/A req/s" in proc.stdout, proc.stdout
    assert "median B/A req/s" in proc.stdout, proc.stdout
    bad = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "load_overhead.py"),
         "--quick", "--ab", os.path.join(ROOT, "docs") + ":bare", "bare"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode != 0 and "not a greqprof checkout" in bad.stderr


@pytest.mark.skipif(shutil.which("wrk") is None,
                    reason="wrk (Debian package) is not installed")
def test_load_benchmark_runs(tmp_path):
    """bench/load_overhead.py --quick: real servers side by side under wrk;
    the greqprof row must have sampled requests and no internal error."""
    out_json = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "load_overhead.py"),
         "--quick", "--only", "gqp-5pct,passthrough", "--json",
         str(out_json)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "INVALID" not in proc.stdout and "SKIPPED" not in proc.stderr, \
        proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(out_json.read_text())["results"]
    assert {"bare", "passthrough", "gqp-5pct"} <= set(results)
    row = results["gqp-5pct"]
    assert row["status"] == "ok", row
    for run in row["runs"]:
        # side by side with a bare app: both rates are measured
        assert run["rps"] > 0 and run["base_rps"] > 0
        mw = run["middleware"]
        # the middleware really sampled under load, and nothing failed
        assert 0 < mw["sampled"] < mw["requests"] and mw["errors"] == 0


@pytest.mark.skipif(shutil.which("wrk") is None,
                    reason="wrk (Debian package) is not installed")
def test_load_benchmark_logs_reports_on_the_api_app(tmp_path):
    """Issue 16's configurations: GET /api (a child greenlet, a 1 ms sleep,
    JSON), each sampled report logged at INFO to a file handler."""
    out_json = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "load_overhead.py"),
         "--quick", "--app", "api", "--only", "gqp-100pct-logged",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out_json.read_text())
    assert data["parameters"]["path"].startswith("/api")
    row = data["results"]["gqp-100pct-logged"]
    assert row["status"] == "ok", row
    for run in row["runs"]:
        mw = run["middleware"]
        # (pct=1.0: all but those over max_open profiles at once)
        assert mw["sampled"] > 0 and mw["errors"] == 0
        assert mw["sampled"] + mw["skipped_full"] == mw["requests"]
        # every sampled profile was delivered (rendered and logged)
        assert mw["delivered"] > 0


def test_report_cost_runs():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "report_cost.py"),
         "--quick"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "text report logged" in proc.stdout
    assert 'bare `logger.info("x")`' in proc.stdout


def test_clock_jumps_runs():
    """bench/clock_jumps.py (no profiler: the thread CPU clock's own
    jumps) reports every burn it made."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "clock_jumps.py"),
         "--rounds", "3", "--threads", "2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    m = re.search(r"burns of 15 ms: (\d+), in 2 threads", proc.stdout)
    assert m and int(m.group(1)) == 3 * (2 + 3), proc.stdout
    assert re.search(r"median 1[5-9]\.\d\d ms", proc.stdout), proc.stdout


def test_route_names_runs():
    """bench/route_names.py counts every call under the route it names."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "route_names.py"),
         "--n", "300", "--reps", "2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "'/items/{id}/detail': 1200" in proc.stdout, proc.stdout
    assert re.search(r"a new id each request +\d+\.\d\d us", proc.stdout)


def test_route_tables_runs():
    """bench/route_tables.py times each periodic pass over the table."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "route_tables.py"),
         "--routes", "40,80", "--repeat", "2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = re.findall(r"^\| (.+?) \| (\d+\.\d) ms \| (\d+\.\d) ms \|$",
                      proc.stdout, re.M)
    assert [r[0] for r in rows] == [
        "recent-window snapshot (tick), 5 % busy",
        "summary line (summary_records + summary_line)",
        "to_records() since start", 'to_records("recent"), 5 % busy',
        'to_records("recent"), all busy'], proc.stdout
