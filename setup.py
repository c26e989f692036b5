"""The build of commlens' C extensions (pyproject.toml lists them), with a missing compiler or missing
Python headers named in one line, with what to install."""

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

NEEDS = ("commlens: building its C extensions needs a C compiler and Python's headers ({error}); install them "
         "(Debian, Ubuntu: apt-get install gcc python3-dev; Fedora: dnf install gcc python3-devel; macOS: "
         "xcode-select --install) and run pip again")


class BuildExt(build_ext):
    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError) as error:
            raise SystemExit(NEEDS.format(error=error)) from None


setup(cmdclass={"build_ext": BuildExt})
