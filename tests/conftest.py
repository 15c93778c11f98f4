"""Shared fixtures: managers that are checked (``m.check()``) and closed at teardown.

``m`` is a small manager for most tests, ``tiny`` one whose 64 KiB fast memory fills after a
few arrays (pressure and eviction tests), ``debug_m`` one in debug mode, and
``make_manager`` / ``tiny_manager`` build more with other sizes or policies. ``assert_eq``
lives in helpers.py: ``from helpers import assert_eq`` (pytest puts this folder on sys.path).
"""

import functools
import os

import pytest

import cachedarrays as ca

SMALL = dict(fast="1MiB", slow="16MiB")
TINY = dict(fast="64KiB", slow="4MiB", granularity=256)


def _dlrm_kernels(specialised):
    """Feature-size specialised DLRM kernels on or off until the generator resumes."""
    from cachedarrays.models.dlrm import kernels, model
    old = kernels.set_specialised(specialised), model.set_specialised(specialised)
    yield
    kernels.set_specialised(old[0])
    model.set_specialised(old[1])


@pytest.fixture(autouse=True, scope="session")
def _generic_dlrm_kernels():
    """The suite runs the generic embedding and interaction kernels: the ones specialised per
    feature size (bit-identical, see the ``specialised`` tests) compile one set per size, tens
    of seconds each on a fresh clone's empty numba cache."""
    yield from _dlrm_kernels(False)


@pytest.fixture
def specialised():
    """Feature-size specialised DLRM kernels on (as outside the test suite) for this test."""
    yield from _dlrm_kernels(True)


@pytest.fixture
def make_manager():
    """``make_manager(**kwargs)`` builds a Manager (default ``SMALL``) for this test; at
    teardown each one still open passes ``m.check()`` and is closed."""
    made = []

    def make(**kwargs):
        m = ca.Manager(**{**SMALL, **kwargs})
        made.append(m)
        return m

    yield make
    try:
        for m in made:
            if not m.closed:
                m.check()
    finally:
        for m in reversed(made):
            m.close()


@pytest.fixture
def m(make_manager):
    """A 1 MiB fast / 16 MiB slow manager with the default LRU policy."""
    return make_manager()


@pytest.fixture
def tiny_manager(make_manager):
    """``tiny_manager(policy=..., policy_options=...)``: a ``TINY`` manager (64 KiB fast,
    256-byte granularity), so a few 10 KiB arrays fill fast memory."""
    return functools.partial(make_manager, **TINY)


@pytest.fixture
def tiny(tiny_manager):
    """A ``TINY`` manager with the default LRU policy."""
    return tiny_manager()


@pytest.fixture
def debug_m(make_manager):
    """A ``SMALL`` manager in debug mode: writes through views kept past their scope are found."""
    return make_manager(debug=True)


@pytest.fixture
def full_file_system(monkeypatch):
    """A file system with a single free block, as ``os.fstatvfs`` reports it to the devices."""
    real = os.fstatvfs

    class OneFreeBlock:
        def __init__(self, st):
            self.f_frsize = st.f_frsize
            self.f_bavail = 1

    monkeypatch.setattr(os, "fstatvfs", lambda fd: OneFreeBlock(real(fd)))
