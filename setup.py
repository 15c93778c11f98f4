"""Build hook: compiles the native heap and copy engine (native/) with cffi."""
from setuptools import setup

setup(cffi_modules=["native/build.py:ffibuilder"])
