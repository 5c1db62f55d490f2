"""The compiled core: two optional C extension modules, built with the package.

Everything else is in pyproject.toml. Each module is optional: where it does not build (no C
compiler, no Python headers, not Linux) the install goes on without it, and gpushare runs
the same protocol in Python (``gpushare info`` and a one-time warning say so). Why
setuptools and not Cython or meson-python: dev/design-notes.md, "The compiled core".
"""

import sys

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11", "-Wall", "-Wno-missing-field-initializers"]

EXTENSIONS = [
    # The compiled core: the Queue region's put and get (used on x86-64, where its lock is the
    # Python path's) and a buffer's handoff at both ends of a Queue, in one module.
    Extension(
        "gpushare._core",
        ["gpushare/_core.c", "gpushare/_region.c", "gpushare/_handoff.c"],
        libraries=["pthread"],
        extra_compile_args=FLAGS,
        optional=True,
    ),
    # The CUDA driver's per-handoff queries, bound in the driver library already loaded.
    Extension(
        "gpushare._cuda._cqueries",
        ["gpushare/_cuda/_queries.c"],
        libraries=["dl"],
        extra_compile_args=FLAGS,
        optional=True,
    ),
]

setup(ext_modules=EXTENSIONS if sys.platform.startswith("linux") else [])
