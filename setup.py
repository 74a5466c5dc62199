"""Package discovery: the top-level folders are the subpackages of `ember` (package-dir in
pyproject.toml maps ember to the repository root), found here so that no hand-kept list can miss one."""
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

TOP = ("daemon", "client", "kernels", "protocol")


class BuildPy(build_py):
    """The root is the `ember` package, and this file lies in it: keep it out of the wheel."""

    def find_package_modules(self, package, package_dir):  # type: ignore[no-untyped-def]
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "ember" and m[1] == "setup")]


setup(packages=["ember"] + [f"ember.{p}" for p in find_packages(include=[f"{t}{s}" for t in TOP for s in ("", ".*")])],
      cmdclass={"build_py": BuildPy})
