"""Build hook: generate the gRPC stubs in pdserve/v1/ from protos/ before packaging.

Everything else about the package lives in pyproject.toml; setuptools merges the two.
The stubs are generated into the source tree (git-ignored), so the same step serves a regular
wheel (`pip install .`, `pip wheel .`) and a PEP 660 editable install (`pip install -e .`),
whose `editable_wheel` command runs `build_py` in editable mode. To regenerate by hand after
editing a .proto: `python setup.py build_protos`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from setuptools import Command, Extension, find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"
PROTO_PACKAGE = "pdserve/v1"  # import path of the protos; also where the stubs land
GENERATED_GLOBS = ("*_pb2.py", "*_pb2_grpc.py", "*_pb2.pyi")


def generate_stubs(root: Path = ROOT) -> list[Path]:
    """Run protoc on every protos/pdserve/v1/*.proto; returns the files written.

    Stale stubs (of a .proto since removed) are deleted first. Imports in the generated code
    read `from pdserve.v1 import common_pb2` because the protos import "pdserve/v1/...".
    """
    from importlib.resources import files

    from grpc_tools import protoc

    proto_root = root / "protos"
    out_dir = root / PROTO_PACKAGE
    protos = sorted((proto_root / PROTO_PACKAGE).glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root / PROTO_PACKAGE}")
    for pattern in GENERATED_GLOBS:
        for stale in out_dir.glob(pattern):
            stale.unlink()
    well_known = str(files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={root}",
        f"--grpc_python_out={root}",
        f"--pyi_out={root}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(p.name for p in protos)}")
    return sorted(p for pattern in GENERATED_GLOBS for p in out_dir.glob(pattern))


class BuildProtos(Command):
    """`python setup.py build_protos`: generate the gRPC stubs in place."""

    description = "generate pdserve/v1 gRPC stubs from protos/"
    user_options: ClassVar[list[tuple[str, str | None, str]]] = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        shipped = list((ROOT / PROTO_PACKAGE).glob("*_pb2.py"))
        if not PROTO_ROOT.is_dir() and shipped:  # an sdist made without protos/: use its stubs
            self.announce("protos/ not found; keeping the stubs in pdserve/v1", level=2)
            return
        for path in generate_stubs():
            self.announce(f"generated {path.relative_to(ROOT)}", level=2)


class BuildPyWithProtos(build_py):
    """build_py that generates the stubs first, so they are packaged (or, editable, importable)."""

    def run(self) -> None:
        self.run_command("build_protos")
        super().run()


# Import path = file path: `pdserve/` holds the shared code (engine, gateway, control plane,
# types, errors, CLI) and each service directory the project was specified with is a top-level
# package of its own, so no static tool needs a mapping.
SERVICE_PACKAGES = ("router", "prefill_svc", "decode_svc", "kvxfer")
PACKAGES = find_packages(include=["pdserve", "pdserve.*", *SERVICE_PACKAGES,
                                  *(f"{p}.*" for p in SERVICE_PACKAGES)])

# The router hashes every prompt it places: chained block hashes in C (pdserve/_blockhash.c).
# Optional: where it cannot be compiled, pdserve.engine.block_manager hashes in Python (the
# same digests, ~5x slower).
BLOCKHASH = Extension("pdserve._blockhash", ["pdserve/_blockhash.c"], optional=True,
                      extra_compile_args=["-O3"])

# The router's threshold placement scores every decode worker per request: in C
# (router/_score.c), the same floats as router.placement.best_of's numpy, which it falls back to.
# -ffp-contract=off: no fused multiply-add, so every rounding is numpy's.
SCORE = Extension("router._score", ["router/_score.c"], optional=True,
                  extra_compile_args=["-O2", "-ffp-contract=off"])

# The decode worker's UCX listener binds the configured host, not every interface
# (kvxfer/listen.py). Optional: without it such a listener refuses to start, unless it was
# asked for every interface.
LISTEN_HOST = Extension("kvxfer._listen_host", ["kvxfer/_listen_host.c"], optional=True,
                        libraries=["dl", "pthread"], extra_compile_args=["-O2"])


def _grpcpp_flags() -> tuple[list[str], list[str]] | None:
    """(compile, link) flags of grpc++ from pkg-config, or None where it is not installed."""
    import shlex
    import shutil
    import subprocess

    if shutil.which("pkg-config") is None:
        return None
    found = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++"], capture_output=True,
                           text=True, check=False)
    if found.returncode != 0:
        return None
    flags = shlex.split(found.stdout)
    return ([f for f in flags if not f.startswith(("-l", "-L"))],
            [f for f in flags if f.startswith(("-l", "-L"))])


# The router's compiled data plane (router/_dataplane.cc, router.dataplane: `--data-plane
# compiled`): grpc++ relays local routes with no Python per token. Optional, and only where
# grpc++'s headers are installed (Debian: libgrpc++-dev); without it the router serves its
# gRPC API with grpc.aio, as by default.
_GRPCPP = _grpcpp_flags()
DATAPLANE = ([Extension("router._dataplane", ["router/_dataplane.cc"], optional=True,
                        language="c++", extra_compile_args=["-O2", "-std=c++17", *_GRPCPP[0]],
                        extra_link_args=_GRPCPP[1])]
             if _GRPCPP is not None else [])

setup(
    packages=PACKAGES,
    ext_modules=[BLOCKHASH, SCORE, LISTEN_HOST, *DATAPLANE],
    package_data={"pdserve": ["_blockhash.pyi"], "router": ["_score.pyi", "_dataplane.pyi"],
                  "pdserve.engine.kernels": ["*.cpp"],
                  "pdserve.v1": ["*.pyi", "py.typed"]},
    cmdclass={"build_protos": BuildProtos, "build_py": BuildPyWithProtos},
)
