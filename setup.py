"""The native host kernel (moefit/kernels/moe.c) is built here, at install time, as a plain
shared library loaded with ctypes. It is optional: without a C compiler the install still
succeeds and moefit runs its torch path, saying so once."""

from setuptools import Extension, setup

HEADERS = ["dots.h", "kquants.h", "ktiles.h", "kpanels.h", "panels.h", "rows.h", "step.h", "delta.h", "dequant.h", "kv.h", "pool.h", "linear.h", "weights.h"]

setup(ext_modules=[Extension("moefit.kernels._moe", ["moefit/kernels/moe.c"], depends=[f"moefit/kernels/{h}" for h in HEADERS],
                             extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno"], libraries=["m", "pthread"],
                             optional=True)])
