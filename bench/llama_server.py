"""llama.cpp's own C++ HTTP server (`llama-server`), built for the benchmarks (bench only).

    python -m bench.llama_server [--dir .llama-server] [--jobs 2]

PyPI is the only source reachable here, and the llama-cpp-python sdist vendors the llama.cpp
sources, so this downloads that sdist (`pip download --no-binary :all: --no-deps`), unpacks
it and builds the `llama-server` target with cmake (Release, `GGML_NATIVE`: the CPU it is
built on, no web UI, no curl): about 5-10 minutes on 2 cores, once. Prints the binary's path.
Never a project dependency; `bench.serve_compare --systems llamacpp,...` runs the binary on
the default model's own GGUF (`pdserve.engine.model_store.default_gguf`).
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


def binary(root: Path = DEFAULT_DIR) -> Path:
    return root / "build" / "bin" / "llama-server"


def version(exe: Path) -> str:
    """What `llama-server --version` says (llama.cpp's build number and commit)."""
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    lines = (res.stdout + res.stderr).splitlines()
    return next((ln.strip() for ln in lines if ln.startswith("version:")), "")


def build(root: Path = DEFAULT_DIR, jobs: int | None = None) -> Path:
    """Download, unpack and build; return the binary. Does nothing if it is built."""
    exe = binary(root)
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
    subprocess.run(["cmake", "-S", str(llama), "-B", str(root / "build"),
                    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"],
                   check=True, timeout=600)
    subprocess.run(["cmake", "--build", str(root / "build"), "--target", "llama-server",
                    "-j", str(jobs or os.cpu_count() or 1)], check=True, timeout=3600)
    if not exe.exists():
        raise RuntimeError(f"the build finished without {exe}")
    return exe


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llama_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--jobs", type=int, default=None)
    args = p.parse_args()
    print(build(args.dir, args.jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
