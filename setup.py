"""The native host kernel (moefit/kernels/moe.c) is built here, at install time, as a plain
shared library loaded with ctypes. It is optional: without a C compiler the install still
succeeds and moefit runs its torch path, saying so once."""

from pathlib import Path

from setuptools import Extension, setup

HEADERS = sorted(str(h) for h in Path("moefit/kernels").glob("*.h"))     # every header moe.c includes: a change rebuilds

setup(ext_modules=[Extension("moefit.kernels._moe", ["moefit/kernels/moe.c"], depends=HEADERS,
                             extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno"], libraries=["m", "pthread"],
                             optional=True)])
