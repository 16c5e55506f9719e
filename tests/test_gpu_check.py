"""benchmarks/gpu_check.sh without a GPU: the dry run's plan fits the device tool's limits (three
calls of at most 8 minutes, every step at most 240 s, at most 8 returned files), every test file and
bench suite the plan names exists, and a real call's plumbing (a step per line in summary.txt,
results copied to $OUT after every step, a failing step failing the call) works with stand-ins."""
import os
import re
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEP = re.compile(r"^  (\w+) +(\d+)s  (.*)$")


def _dry_run(*args):
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True,
                          timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def _plan(text):
    calls, current = {}, None
    for line in text.splitlines():
        if line.startswith("call "):
            current = calls.setdefault(int(line.split()[1].rstrip(":")), {"steps": [], "returns": []})
        elif STEP.match(line):
            name, limit, cmd = STEP.match(line).groups()
            current["steps"].append((name, int(limit), cmd))
        elif "returns" in line:
            current["returns"] = line.split(": ", 1)[1].split()
    return calls


def test_dry_run_shows_three_calls_within_limits():
    rc, text = _dry_run()
    assert rc == 0, text
    calls = _plan(text)
    assert sorted(calls) == [1, 2, 3], text
    for n, call in calls.items():
        limits = [limit for _, limit, _ in call["steps"]]
        assert call["steps"] and max(limits) <= 240 and sum(limits) <= 480, (n, call["steps"])
        assert 1 <= len(call["returns"]) <= 8 and "summary.txt" in call["returns"]
        assert "results.tar.gz" in call["returns"]
    names = [s[0] for s in calls[1]["steps"]]
    assert names.index("build") < names.index("tests_1rank") < names.index("pack")
    assert any(f.endswith(".so") for f in calls[1]["returns"]) and "triton_cache.tar.gz" in calls[1]["returns"]
    for n in (2, 3):  # no rebuild: the carried extension is installed first
        assert calls[n]["steps"][0][0] == "install" and "build" not in [s[0] for s in calls[n]["steps"]]
    rc, one = _dry_run("--call", "2")
    assert rc == 0 and sorted(_plan(one)) == [2]


def test_plan_names_only_what_exists():
    """Every test file, script and bench suite the plan runs is in the repository."""
    _, text = _dry_run()
    cmds = " ".join(cmd for call in _plan(text).values() for _, _, cmd in call["steps"])
    paths = set(re.findall(r"\b(?:tests|benchmarks)/[\w/]+\.py\b", cmds))
    assert paths and all((ROOT / p).exists() for p in paths), paths
    suites = [s for m in re.findall(r"--suites (\S+)", cmds) for s in m.split(",")]
    assert suites and all((ROOT / "benchmarks" / f"bench_{s}.py").exists() for s in suites), suites
    functions = set(re.findall(r"^(gpu_\w+)\(\)", SCRIPT.read_text(), re.M))
    used = {cmd.split()[0] for call in _plan(text).values() for _, _, cmd in call["steps"]
            if cmd.startswith("gpu_")}
    assert used and used <= functions, used - functions


def test_a_call_records_every_step_and_returns_files(tmp_path):
    """Call 3 with stand-ins (PYTHON=true: every Python step passes at once; the sanitizer and the
    carried extension are missing, so those steps fail): every step is in summary.txt with its rc,
    $OUT holds the summary, env.txt and the results tarball, and the call's status is 1."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON="true", PATH="/usr/bin:/bin",
               GPU_CHECK_RESULTS=str(tmp_path / "results"))
    proc = subprocess.run(["bash", str(SCRIPT), "--call", "3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    rcs = dict(re.findall(r"^(\w+) +rc=(\d+)", summary, re.M))
    assert set(rcs) == {"install", "env", "bench_vr", "bench_1gpu", "racecheck"}, summary
    assert rcs["install"] != "0" and rcs["bench_vr"] == "0" and rcs["racecheck"] != "0", summary
    with tarfile.open(out / "results.tar.gz") as tar:
        logs = {Path(n).name for n in tar.getnames()}
    assert {"install.log", "bench_vr.log", "summary.txt"} <= logs, logs
    assert (out / "env.txt").exists()
