"""Build the light client from the repository's files: compile ../../protos into
pdserve/v1 and copy pdserve/client.py, straight into the build directory.

`pdserve` is left without an __init__.py (a namespace package), so this distribution holds
only `pdserve.client` and `pdserve.v1`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


class BuildClient(build_py):
    def run(self) -> None:
        super().run()
        from importlib.resources import files

        from grpc_tools import protoc

        out = Path(self.build_lib)
        package = out / "pdserve"
        (package / "v1").mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / "pdserve" / "client.py", package / "client.py")
        shutil.copy2(REPO / "pdserve" / "v1" / "__init__.py", package / "v1" / "__init__.py")
        (package / "v1" / "py.typed").touch()
        protos = sorted((REPO / "protos" / "pdserve" / "v1").glob("*.proto"))
        if not protos:
            raise RuntimeError(f"no protos under {REPO / 'protos'}: build from a checkout")
        args = ["grpc_tools.protoc", f"-I{REPO / 'protos'}", f"-I{files('grpc_tools') / '_proto'}",
                f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}",
                *map(str, protos)]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")


class ClientDistribution(Distribution):
    def has_pure_modules(self) -> bool:  # no source packages here, but build_py writes them
        return True


setup(packages=[], distclass=ClientDistribution, cmdclass={"build_py": BuildClient})
