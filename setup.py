"""Build hooks: generates the gRPC stubs from protos/ before packaging (never committed), and
compiles the CPU kernels (`specinfer/engine/layers/cpu_*.c`) where a C compiler is found.

The kernel is optional: without a compiler, or where it fails to build, the package installs
without it and the engine uses torch's kernels instead.
"""

import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


sys.path.insert(0, str(Path(__file__).resolve().parent))


class BuildWithStubs(build_py):
    def run(self):
        from specinfer_build import generate_stubs

        generate_stubs()
        super().run()


# A plain C library loaded with ctypes (no Python API); OpenMP threads share torch's runtime.
CPU_GEMM = Extension(
    "specinfer.engine.layers._cpu_gemm",
    sources=["specinfer/engine/layers/cpu_gemm.c", "specinfer/engine/layers/cpu_norm.c",
             "specinfer/engine/layers/cpu_rope.c", "specinfer/engine/layers/cpu_attention.c"],
    extra_compile_args=["-O3", "-fopenmp", "-std=c11"],
    extra_link_args=["-fopenmp"],
    optional=True,
)

setup(cmdclass={"build_py": BuildWithStubs}, ext_modules=[CPU_GEMM])
