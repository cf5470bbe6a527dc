"""llama.cpp's own C++ HTTP server (`llama-server`), built for the benchmarks (bench only).

    python -m bench.llama_server [--dir .llama-server] [--jobs 2] [--no-amx]

PyPI is the only source reachable here, and the llama-cpp-python sdist vendors the llama.cpp
sources, so this downloads that sdist (`pip download --no-binary :all: --no-deps`), unpacks
it and builds the `llama-server` target with cmake (Release, `GGML_NATIVE`: the CPU it is
built on, no web UI, no curl): about 5-10 minutes on 2 cores, once. Prints the binary's path.
Never a project dependency; `bench.serve_compare --systems llamacpp,...` runs the binary on
the default model's own GGUF (`pdserve.engine.model_store.default_gguf`).

`--no-amx` builds into `build-noamx/` for CPUs where llama.cpp's AMX path crashes (SIGSEGV at
its first evaluation on a Sapphire Rapids VM, twice): `GGML_NATIVE` off and every other vector
extension this CPU reports turned on by name, AMX off. Pass its binary as `--llama-server`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / ".llama-server"  # git-ignored
SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp; the version issue 20 measured


# ggml's CMake switch for each /proc/cpuinfo flag it can use (GGML_NATIVE off: set by name).
_GGML_ISA = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "avx_vnni": "GGML_AVX_VNNI",
             "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
             "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
             "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2"}


def binary(root: Path = DEFAULT_DIR, amx: bool = True) -> Path:
    return root / ("build" if amx else "build-noamx") / "bin" / "llama-server"


def _isa_flags(amx: bool) -> list[str]:
    """GGML_NATIVE, or (no AMX) this CPU's other extensions by name."""
    if amx:
        return ["-DGGML_NATIVE=ON"]
    from pdserve.engine.cpu import cpu_info

    flags = cpu_info().flags
    return (["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
             "-DGGML_AMX_BF16=OFF"]
            + [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _GGML_ISA.items()])


def version(exe: Path) -> str:
    """What `llama-server --version` says (llama.cpp's build number and commit)."""
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    lines = (res.stdout + res.stderr).splitlines()
    return next((ln.strip() for ln in lines if ln.startswith("version:")), "")


def build(root: Path = DEFAULT_DIR, jobs: int | None = None, amx: bool = True) -> Path:
    """Download, unpack and build; return the binary. Does nothing if it is built."""
    exe = binary(root, amx)
    out = exe.parents[1]
    if exe.exists():
        return exe
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    if not (tars := sorted(src.glob("llama_cpp_python-*.tar.gz"))):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                        "--no-deps", SDIST, "-d", str(src)], check=True, timeout=1800)
        tars = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(tars[-1]) as tar:
        top = tar.getnames()[0].split("/")[0]
        if not (src / top).exists():
            tar.extractall(src, filter="data")
    llama = src / top / "vendor" / "llama.cpp"
    subprocess.run(["cmake", "-S", str(llama), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                    *_isa_flags(amx), "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=ON"],
                   check=True, timeout=600)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama-server",
                    "-j", str(jobs or os.cpu_count() or 1)], check=True, timeout=3600)
    if not exe.exists():
        raise RuntimeError(f"the build finished without {exe}")
    return exe


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llama_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--no-amx", action="store_true", help="build without llama.cpp's AMX path "
                   "(into build-noamx/)")
    args = p.parse_args()
    print(build(args.dir, args.jobs, amx=not args.no_amx))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
