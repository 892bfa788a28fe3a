"""Build hook: generates the gRPC stubs from protos/ before packaging (never committed)."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


sys.path.insert(0, str(Path(__file__).resolve().parent))


class BuildWithStubs(build_py):
    def run(self):
        from specinfer_build import generate_stubs

        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
