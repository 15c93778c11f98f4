"""Build hook: compiles the native heap and copy engine (native/) with cffi, and the manager's
per-array records (native/records.c) as a CPython extension."""
import numpy
from setuptools import Extension, setup

setup(
    cffi_modules=["native/build.py:ffibuilder"],
    ext_modules=[Extension("cachedarrays._records", ["native/records.c", "native/select.c", "native/walk.c"],
                           include_dirs=[numpy.get_include(), "native"],
                           extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                               "-Wno-missing-field-initializers"])],
)
