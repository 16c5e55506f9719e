"""Install pyfused; build the CUDA extension pyfused._C where it can be built (docs/BUILD.md).

    pip install --no-build-isolation -e ".[test]"   # builds _C against the installed torch
    pip install -e .                                 # isolated build env has no torch: no _C

Environment switches: PYFUSED_SKIP_CUDA_BUILD=1 (build no extension), TORCH_CUDA_ARCH_LIST
(default below), MAX_JOBS (default from cores and free memory), CUDA_HOME (toolkit root; found
otherwise), PYFUSED_REQUIRE_EXT=1 (fail instead of building without _C; CI sets it).
"""
import glob
import importlib.util
import os
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.develop import develop as _setuptools_develop

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "8.0;9.0a"  # A100, H100 (9.0a: sm_90a features)
GIB_PER_COMPILE_JOB = 3  # peak RSS of one nvcc/g++ job on a torch-including file, with margin


def say(msg):
    print(f"[pyfused setup] {msg}", flush=True)


def cuda_sources():
    """Every .cpp and .cu file in csrc/, relative to HERE (setuptools wants relative paths). Each
    compiles to <stem>.o, so no two may share a stem (hence csrc/flags.cpp beside flags_cuda.cu)."""
    sources = sorted(os.path.relpath(path, HERE) for pattern in ("*.cpp", "*.cu")
                     for path in glob.glob(os.path.join(HERE, "csrc", pattern)))
    stems = [os.path.splitext(os.path.basename(path))[0] for path in sources]
    shared = sorted({stem for stem in stems if stems.count(stem) > 1})
    if shared:
        sys.exit(f"[pyfused setup] csrc/ sources share a stem, and each compiles to <stem>.o: "
                 f"{shared}")
    return sources


def load_ext_helpers():
    """pyfused/_ext.py by path: importing the package would import torch, which an isolated build
    environment does not have. It holds the toolkit search shared with the tests."""
    spec = importlib.util.spec_from_file_location("_pyfused_ext_for_setup",
                                                  os.path.join(HERE, "pyfused", "_ext.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(module)
    return module


def default_max_jobs():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    avail_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass
    jobs = cores or 1
    if avail_gib is not None:
        jobs = min(jobs, int(avail_gib // GIB_PER_COMPILE_JOB))
    mem = f"{avail_gib:.1f} GiB available" if avail_gib is not None else "memory unknown"
    return max(1, jobs), f"{cores} cores, {mem}, {GIB_PER_COMPILE_JOB} GiB per job"


def skip(reason):
    if os.environ.get("PYFUSED_REQUIRE_EXT", "") == "1":
        sys.exit(f"[pyfused setup] PYFUSED_REQUIRE_EXT=1 but pyfused._C cannot be built: {reason}")
    say(f"building WITHOUT the CUDA extension pyfused._C: {reason}. pyfused works without it; "
        f"the fused method reports itself unavailable.")
    return [], {}


def cuda_extension():
    """(ext_modules, cmdclass) for pyfused._C, or ([], {}) with the reason printed."""
    helpers = load_ext_helpers()
    if os.environ.get(helpers.SKIP_ENV, "") not in ("", "0"):
        return skip(helpers.build_skip_reason("any", None))
    try:
        import torch
    except ImportError as e:
        return skip(f"torch is not importable in this build environment ({e}); an isolated build "
                    f"(plain `pip install .`) has no torch: use `{helpers.REBUILD_HINT}`")
    toolkit = helpers.find_cuda_toolkit(report=say)
    reason = helpers.build_skip_reason(torch.version.cuda, toolkit)
    if reason:
        return skip(reason)

    # torch.utils.cpp_extension guesses CUDA_HOME when it is imported, from the nvcc on PATH; that
    # guess is wrong when nvcc is a wrapper script (it would give /usr/local). Set ours first, and
    # again on the module in case something imported it earlier.
    os.environ["CUDA_HOME"] = toolkit.home
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = toolkit.home
    say(f"CUDA toolkit {toolkit.version or '(version unknown)'} at {toolkit.home} "
        f"(found by {toolkit.found_by}); torch {torch.__version__} built with CUDA {torch.version.cuda}")

    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCH_LIST
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    origin = "from TORCH_CUDA_ARCH_LIST" if arch_list != DEFAULT_ARCH_LIST else "default"
    say(f"CUDA arch list: {arch_list} ({origin}; set TORCH_CUDA_ARCH_LIST to change it)")

    if not os.environ.get("MAX_JOBS"):
        jobs, why = default_max_jobs()
        os.environ["MAX_JOBS"] = str(jobs)
        say(f"MAX_JOBS={jobs} ({why}; set MAX_JOBS to change it)")
    else:
        say(f"MAX_JOBS={os.environ['MAX_JOBS']} (from the environment)")
    if not cpp_extension.is_ninja_available():
        say("ninja is not installed: torch falls back to its slow serial build (pip install ninja)")

    # The toolkit's own include/ first, so that for a header present in both, the compiler's
    # version wins; the wheels' folders only supply what a minimal toolkit lacks (cublas_v2.h...).
    wheel_includes = helpers.nvidia_include_dirs()
    say("include dirs from nvidia wheels: " + (", ".join(wheel_includes) or "none found"))
    ext = cpp_extension.CUDAExtension(
        name="pyfused._C",
        sources=cuda_sources(),
        include_dirs=[toolkit.include] + wheel_includes,
        extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O2", "-lineinfo"]},
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension}


class develop(_setuptools_develop):
    """`setup.py develop` in the current environment, as it always ran.

    pip before 25 installs a project that has no pyproject.toml in editable mode by running
    `setup.py develop`, in the current environment (that is what --no-build-isolation asks for).
    setuptools >= 80 turned `develop` into `pip install -e . --use-pep517`, whose build runs in an
    isolated environment without torch: `pip install --no-build-isolation -e .` would then build no
    _C. Here the same call gets --no-build-isolation. The older, real develop command (it has
    install_for_development) already builds here and is left alone.
    """

    def run(self):
        if hasattr(_setuptools_develop, "install_for_development"):
            return super().run()
        cmd = ([sys.executable, "-m", "pip", "install", "-e", ".", "--use-pep517",
                "--no-build-isolation"]
               + ["--target", self.install_dir] * bool(self.install_dir)
               + ["--no-deps"] * bool(self.no_deps)
               + ["--user"] * bool(self.user)
               + ["--prefix", self.prefix] * bool(self.prefix)
               + ["--index-url", self.index_url] * bool(self.index_url))
        say("setup.py develop -> " + " ".join(cmd[1:]))
        subprocess.check_call(cmd, cwd=HERE)


ext_modules, cmdclass = cuda_extension()
cmdclass["develop"] = develop

setup(
    name="pyfused",
    version="0.1.0",
    description="Fused collective-compute ops for PyTorch (GEMMs overlapped with collectives)",
    # the bench suites live in benchmarks/ at the top and install as pyfused.benchmarks
    packages=find_packages(include=["pyfused", "pyfused.*"], exclude=["pyfused.benchmarks"])
    + ["pyfused.benchmarks"],
    package_dir={"pyfused.benchmarks": "benchmarks"},
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "packaging"],
    extras_require={
        # opcheck runs without expecttest; transformers: the parallelize() tests build tiny models
        "test": ["pytest", "pytest-timeout", "hypothesis", "numpy", "transformers>=5.17",
                 "rich", "tqdm", "matplotlib"],
        "bench": ["rich", "tqdm", "matplotlib", "transformers>=5.17"],
        "models": ["transformers>=5.17"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
