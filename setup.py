"""The native host kernel (moefit/kernels/moe.c) is built here, at install time, as a plain
shared library loaded with ctypes. It is optional: without a C compiler the install still
succeeds and moefit runs its torch path, saying so once."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("moefit.kernels._moe", ["moefit/kernels/moe.c"], depends=["moefit/kernels/dots.h", "moefit/kernels/kquants.h",
                                                                               "moefit/kernels/rows.h", "moefit/kernels/step.h",
                                                                               "moefit/kernels/delta.h", "moefit/kernels/dequant.h", "moefit/kernels/pool.h"],
                             extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno"], libraries=["m", "pthread"],
                             optional=True)])
