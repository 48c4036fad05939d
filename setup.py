"""Builds the C++ targets of bitquilt/native_build.py into the package's `_native/` at install time (pip install . and
pip install -e .): a target that does not build is reported and left out, and the install goes on (the torch
reference path runs; bitquilt-run and bitquilt-native say how to build what is missing)."""

import importlib.util
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _builder():
    """bitquilt/native_build.py, loaded by path: importing the package here would import it from wherever it is
    installed, or not at all."""
    spec = importlib.util.spec_from_file_location("bitquilt_native_build", ROOT / "bitquilt" / "native_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class BuildPyWithNative(build_py):
    """build_py, then the C++ targets: into the checkout for an editable install, else beside the built package."""

    def run(self) -> None:
        super().run()
        package = ROOT / "bitquilt" if self.editable_mode else Path(self.build_lib) / "bitquilt"
        _builder().build_all(package / "_native", ROOT / "csrc", log=lambda line: print(line, file=sys.stderr))


class BinaryDistribution(Distribution):
    """A wheel tagged for this platform and Python: it carries compiled code."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithNative}, distclass=BinaryDistribution)
