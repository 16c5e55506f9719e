"""The CUDA extension pyfused._C: how setup.py finds a toolkit, the build switches, and the
signal-flag ops it registers (schema, CPU/Meta/fake kernels, opcheck, torch.compile, CUDA streams).

Tests that need ``_C`` take the ``ext`` fixture. It skips only where ``_C`` was deliberately not
built (PYFUSED_SKIP_CUDA_BUILD, a CPU build of torch, no CUDA toolkit: the reasons setup.py itself
uses); anywhere else a missing ``_C`` is a failure, and with PYFUSED_REQUIRE_EXT=1 (CI) always.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from pyfused import _ext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ext():
    module = _ext.load()
    if module is not None:
        return module
    reason = _ext.build_skip_reason(torch.version.cuda, _ext.find_cuda_toolkit())
    if os.environ.get("PYFUSED_REQUIRE_EXT") == "1" or reason is None:
        pytest.fail(f"pyfused._C must be importable here but is not: {_ext.load_error()}")
    pytest.skip(f"pyfused._C was deliberately not built: {reason}")


@pytest.fixture
def flags_mod(ext):
    from pyfused.comm import flags

    return flags


# --- toolkit discovery and build switches (no extension needed) ------------------------------


def _fake_toolkit(root, version=13000):
    """A directory that passes for a toolkit: bin/nvcc an executable binary, include/cuda.h."""
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "include"))
    shutil.copy("/bin/true", os.path.join(root, "bin", "nvcc"))
    with open(os.path.join(root, "include", "cuda.h"), "w") as f:
        f.write(f"#define CUDA_VERSION {version}\n")
    return root


def _wrapper(bindir, target):
    os.makedirs(bindir)
    path = os.path.join(bindir, "nvcc")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec {target} "$@"\n')
    os.chmod(path, 0o755)
    return path


def test_toolkit_found_through_wrapper_script(tmp_path, monkeypatch):
    real = _fake_toolkit(str(tmp_path / "cuda-13.0"))
    wrapper_dir = str(tmp_path / "wrap" / "bin")
    _wrapper(wrapper_dir, os.path.join(real, "bin", "nvcc"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", wrapper_dir + os.pathsep + os.environ["PATH"])
    rejected = []
    tk = _ext.find_cuda_toolkit(report=rejected.append)
    assert tk is not None and tk.home == os.path.realpath(real), (tk, rejected)
    assert tk.version == "13.0" and "nvcc on PATH" in tk.found_by
    # the wrapper's own root (what torch would guess) was looked at and refused
    assert any("is a script, not the compiler" in r for r in rejected), rejected


def test_toolkit_env_var_wins_and_bad_one_is_reported(tmp_path, monkeypatch):
    real = _fake_toolkit(str(tmp_path / "tk"), version=12080)
    monkeypatch.setenv("CUDA_HOME", real)
    tk = _ext.find_cuda_toolkit()
    assert tk.home == os.path.realpath(real) and tk.found_by == "$CUDA_HOME" and tk.version == "12.8"

    bogus = tmp_path / "bogus"
    (bogus / "bin").mkdir(parents=True)
    monkeypatch.setenv("CUDA_HOME", str(bogus))
    rejected = []
    tk = _ext.find_cuda_toolkit(report=rejected.append)
    assert tk is None or tk.home != os.path.realpath(bogus)
    assert any("$CUDA_HOME" in r and "no bin/nvcc" in r for r in rejected), rejected


def test_build_skip_reasons(tmp_path, monkeypatch):
    monkeypatch.delenv(_ext.SKIP_ENV, raising=False)
    tk = _ext._toolkit_at(_fake_toolkit(str(tmp_path / "tk")), "test")[0]
    assert _ext.build_skip_reason("13.0", tk) is None
    assert "CPU build" in _ext.build_skip_reason(None, tk)
    assert "no CUDA toolkit" in _ext.build_skip_reason("13.0", None)
    assert "is 13.0 but torch was built with CUDA 12.8" in _ext.build_skip_reason("12.8", tk)
    monkeypatch.setenv(_ext.SKIP_ENV, "1")
    assert _ext.SKIP_ENV in _ext.build_skip_reason("13.0", tk)


def _run_setup(env_updates):
    env = {**os.environ, **env_updates}
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_setup_skip_switch_builds_nothing_and_says_why():
    if not os.path.isfile(os.path.join(REPO, "setup.py")):
        pytest.fail(f"tests run from a checkout; no setup.py in {REPO}")
    out = _run_setup({"PYFUSED_SKIP_CUDA_BUILD": "1", "PYFUSED_REQUIRE_EXT": "0"})
    assert out.returncode == 0, out.stderr
    assert "building WITHOUT the CUDA extension pyfused._C: PYFUSED_SKIP_CUDA_BUILD=1" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "pyfused"

    out = _run_setup({"PYFUSED_SKIP_CUDA_BUILD": "1", "PYFUSED_REQUIRE_EXT": "1"})
    assert out.returncode != 0
    assert "PYFUSED_REQUIRE_EXT=1 but pyfused._C cannot be built" in out.stderr


def test_load_error_says_why_when_not_built(monkeypatch):
    def missing(name, *args):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(_ext, "_tried", False)
    monkeypatch.setattr(_ext, "_module", None)
    monkeypatch.setattr(_ext, "_error", None)
    monkeypatch.setattr(_ext.importlib, "import_module", missing)
    monkeypatch.setenv(_ext.SKIP_ENV, "1")
    assert not _ext.available()
    assert _ext.load_error() == "pyfused._C is not built: PYFUSED_SKIP_CUDA_BUILD=1 is set"


# --- the ops -----------------------------------------------------------------------------------


def test_ops_registered_with_schema_and_kernels(ext):
    ops = torch.ops.pyfused
    assert str(ops.signal_flag.default._schema) == (
        "pyfused::signal_flag(Tensor(a!) flags, int index, int value) -> ()")
    assert str(ops.wait_flag.default._schema) == (
        "pyfused::wait_flag(Tensor flags, int index, int value, int timeout_ms=60000) -> ()")
    for op in ("pyfused::signal_flag", "pyfused::wait_flag"):
        for key in ("CPU", "CUDA", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, key), (op, key)
    # the Python custom ops of the same namespace are still there (FRAGMENT, not a second LIBRARY)
    import pyfused.ops  # noqa: F401

    assert torch.ops.pyfused.all_gather_matmul.default is not None


def test_cpu_semantics(flags_mod):
    f = flags_mod.new_flags(5)
    assert f.dtype == torch.int32 and f.tolist() == [0] * 5
    flags_mod.signal_flag(f, 3, 7)
    assert f.tolist() == [0, 0, 0, 7, 0]
    flags_mod.wait_flag(f, 3, 7)  # already there: returns
    flags_mod.wait_flag(f, 3, 6)  # >=, not ==
    with pytest.raises(RuntimeError, match=r"wait_flag on CPU: flags\[3\] is 7, below the awaited 8. "
                                           r"A CPU wait cannot block"):
        flags_mod.wait_flag(f, 3, 8)
    view = torch.zeros(10, dtype=torch.int32)[::2]  # strided 1-D view: flag i is element 2i
    flags_mod.signal_flag(view, 4, -3)
    assert view.tolist() == [0, 0, 0, 0, -3]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_argument_errors(flags_mod, device):
    f = torch.zeros(4, dtype=torch.int32, device=device)
    cases = [
        ((torch.zeros(4, device=device), 0, 1), "flags must be an int32 tensor, got Float"),
        ((torch.zeros(2, 2, dtype=torch.int32, device=device), 0, 1), "flags must be 1-D, got 2 dims"),
        ((f, 4, 1), "index 4 is out of range for 4 flags"),
        ((f, -1, 1), "index must be >= 0, got -1"),
        ((f, 0, 2**31), "value 2147483648 does not fit the int32 flag"),
    ]
    for fn in (flags_mod.signal_flag, flags_mod.wait_flag):
        for args, message in cases:
            with pytest.raises(RuntimeError, match=message):
                fn(*args)
    with pytest.raises(RuntimeError, match="timeout_ms must be >= 0"):
        flags_mod.wait_flag(f, 0, 0, timeout_ms=-1)


def test_meta_and_fake_kernels(flags_mod):
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = torch.empty(6, dtype=torch.int32, device="meta")
    assert torch.ops.pyfused.signal_flag(meta, 5, 1) is None
    assert torch.ops.pyfused.wait_flag(meta, 5, 1) is None  # meta never blocks nor checks values
    with FakeTensorMode():
        for device in ("cpu", "cuda"):  # fake CUDA tensors need no GPU
            f = torch.empty(6, dtype=torch.int32, device=device)
            assert flags_mod.signal_flag(f, 5, 1) is None
            assert flags_mod.wait_flag(f, 0, 1, timeout_ms=10) is None
            assert f.shape == (6,) and f.dtype == torch.int32 and f.device.type == device
            with pytest.raises(RuntimeError, match="index 6 is out of range for 6 flags"):
                flags_mod.wait_flag(f, 6, 1)


def test_opcheck_cpu(ext):
    f = torch.zeros(7, dtype=torch.int32)
    torch.library.opcheck(torch.ops.pyfused.signal_flag.default, (f, 6, 3))
    f[2] = 4
    torch.library.opcheck(torch.ops.pyfused.wait_flag.default, (f, 2, 4))
    torch.library.opcheck(torch.ops.pyfused.wait_flag.default, (f, 2, 1, 0))


def test_compiled_graph_keeps_the_wait(flags_mod):
    """wait_flag returns nothing and mutates nothing; a graph must still run it (side effect)."""
    g = torch.fx.Graph()
    x = g.placeholder("f")
    g.call_function(torch.ops.pyfused.wait_flag.default, (x, 1, 5))
    g.output(x)
    g.eliminate_dead_code()
    assert any(n.target is torch.ops.pyfused.wait_flag.default for n in g.nodes)

    def step(f):
        flags_mod.signal_flag(f, 0, 3)
        flags_mod.wait_flag(f, 0, 3)
        flags_mod.wait_flag(f, 1, 5)
        return f * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    f = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"flags\[1\] is 0, below the awaited 5"):
        compiled(f)
    f[1] = 5
    assert compiled(f).tolist() == [6, 10, 0]
    assert f.tolist() == [3, 5, 0]  # the functionalized signal reached the input


# --- CUDA (run on a machine with a GPU: python -m pytest -m gpu tests/test_extension.py) --------------


@pytest.mark.gpu
def test_cuda_wait_orders_consumer_after_producer(flags_mod):
    """The consumer's copy is enqueued before the producer even writes; only the flag orders it."""
    f = flags_mod.new_flags(1, "cuda")
    data = torch.zeros(1 << 20, device="cuda")
    out = torch.full_like(data, -1.0)
    torch.cuda.synchronize()
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        flags_mod.wait_flag(f, 0, 1)
        out.copy_(data)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(100_000_000)  # ~50 ms: without the wait the copy would read zeros
        data.fill_(7.0)
        flags_mod.signal_flag(f, 0, 1)
    torch.cuda.synchronize()
    assert f.item() == 1
    assert torch.equal(out, torch.full_like(out, 7.0)), out.unique()


@pytest.mark.gpu
def test_cuda_ping_pong_epochs(flags_mod):
    """Two streams take turns on one tensor for many rounds, all enqueued up front, flags never
    reset (epochs). Any misordering changes the result: x -> (x + 1) * 2 is not commutative."""
    rounds = 40
    f = flags_mod.new_flags(2, "cuda")
    x = torch.zeros((), dtype=torch.float64, device="cuda")
    torch.cuda.synchronize()
    s_add, s_mul = torch.cuda.Stream(), torch.cuda.Stream()
    for k in range(1, rounds + 1):
        with torch.cuda.stream(s_add):
            if k > 1:
                flags_mod.wait_flag(f, 0, k - 1)  # the multiply of round k-1 is done
            torch.cuda._sleep(20_000)
            x.add_(1)
            flags_mod.signal_flag(f, 1, k)
        with torch.cuda.stream(s_mul):
            flags_mod.wait_flag(f, 1, k)
            x.mul_(2)
            flags_mod.signal_flag(f, 0, k)
    torch.cuda.synchronize()
    expected = 0.0
    for _ in range(rounds):
        expected = (expected + 1) * 2
    assert x.item() == expected and f.tolist() == [rounds, rounds]


@pytest.mark.gpu
def test_cuda_signal_runs_after_earlier_work_on_its_stream(flags_mod):
    f = flags_mod.new_flags(3, "cuda")
    torch.cuda.synchronize()
    s, observer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)  # ~50 ms of earlier work
        flags_mod.signal_flag(f, 2, 9)
        flags_mod.wait_flag(f, 2, 9)  # signal then wait on one stream: returns, no deadlock
    with torch.cuda.stream(observer):  # not ordered after s: looks while s is still sleeping
        during = f.clone()
    torch.cuda.synchronize()
    assert during.tolist() == [0, 0, 0], "the signal ran before the work enqueued ahead of it"
    assert f.tolist() == [0, 0, 9]


@pytest.mark.gpu
def test_cuda_wait_timeout_fails_instead_of_hanging():
    """A wait nothing will satisfy must end the process with the flag named, not hang."""
    script = textwrap.dedent("""
        import torch
        from pyfused.comm import flags
        f = flags.new_flags(4, "cuda")
        flags.wait_flag(f, 3, 1, timeout_ms=300)
        torch.cuda.synchronize()
        print("UNREACHABLE: synchronize returned")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "UNREACHABLE" not in text
    assert "pyfused::wait_flag timed out after 300 ms: flags[3] is 0, waiting for >= 1" in text, text


@pytest.mark.gpus(2)
def test_cuda_flags_on_another_device(flags_mod):
    """The ops run on the flags' device and its current stream, whatever the current device."""
    torch.cuda.set_device(0)
    f = flags_mod.new_flags(2, "cuda:1")
    flags_mod.signal_flag(f, 1, 4)
    flags_mod.wait_flag(f, 1, 4)
    torch.cuda.synchronize(1)
    assert f.tolist() == [0, 4]
