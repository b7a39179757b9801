"""Builds the one native helper, handoff/hostflag.c.

It is a plain C shared object (no Python.h, no CUDA) loaded with ctypes, so its waits run
without the GIL and without any Python object in the hot path. setuptools' Extension is used
only as the portable way to get a compiled .so inside the package at install time.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "draftrelay.handoff._hostflag",
            sources=["src/draftrelay/handoff/hostflag.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-std=c11"],
            extra_link_args=["-lpthread"],
        )
    ]
)
