"""Views that leave their scope: read-only views stay read-only; debug mode finds stale writes."""

import logging
import random

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.errors import CachedArraysError


def stale_writes(m):
    return m.stats()["events"]["debug_stale_writes"]["count"]


# ---- read-only views -------------------------------------------------------------------------

@pytest.mark.parametrize("placement", ["fast", "slow"])
def test_a_readable_view_cannot_be_made_writeable(placement, m):
    x = ca.asarray(np.arange(100.0).reshape(10, 10), manager=m, placement=placement)
    with ca.readable(x) as a:
        for v in (a, a[2:5], a.T, a.reshape(-1)):
            assert not v.flags.writeable
            with pytest.raises(ValueError):
                v.flags.writeable = True
            with pytest.raises(ValueError):
                v[0] = -1.0
    with ca.access((x,), ()) as (r,):
        with pytest.raises(ValueError):
            r.flags.writeable = True
    r = x.object.primary
    ro = m.ndarray(r, np.float64, (100,), readonly=True)
    with pytest.raises(ValueError):
        ro.flags.writeable = True
    assert float(x.sum()) == 4950.0                 # nothing was written


# ---- debug mode ------------------------------------------------------------------------------

def test_debug_mode_reports_a_stale_write_when_the_memory_is_reused(caplog, debug_m):
    x = ca.asarray(np.arange(1000.0), manager=debug_m)
    assert x.device == "fast"
    with ca.writable(x) as w:
        part = w[:]                                  # made inside: NumPy cannot close it
    ca.evict(x)                                      # x moves; part still points at fast memory
    with pytest.raises(ValueError, match="read-only"):
        w[3] = 7.0                                   # the scope's own view refuses writes
    part[3] = 7.0                                    # the bug: a view used after its scope
    assert stale_writes(debug_m) == 0
    with caplog.at_level(logging.WARNING, logger="cachedarrays.debug"):
        y = ca.zeros(1000, manager=debug_m)          # reuses the memory x left behind
    assert y.device == "fast"
    assert stale_writes(debug_m) == 1
    assert f"object {x.object.id} (7.8 KiB) moved from 'fast' to 'slow'" in caplog.text
    with pytest.raises(CachedArraysError, match=f"object {x.object.id} \\(7.8 KiB\\)"):
        debug_m.check()
    debug_m.check()                                  # reported once
    assert float(x[3]) == 3.0 and float(y.sum()) == 0.0


def test_debug_check_finds_a_stale_write_before_reuse_and_names_the_object(debug_m):
    x = ca.asarray(np.arange(1000.0), manager=debug_m)
    keep = ca.ones(10, manager=debug_m)
    with ca.writable(x) as w:
        w = w[:]                                     # made inside: NumPy cannot close it
    ca.unsafe_free(x)
    w[-1] = 1.0
    with pytest.raises(CachedArraysError, match=f"object {x.object.id} \\(7.8 KiB\\) was "
                                                "freed.*valid inside the with-block only"):
        debug_m.check()
    assert stale_writes(debug_m) == 1
    assert float(keep.sum()) == 10.0


def test_debug_mode_follows_blocks_moved_by_defrag(debug_m):
    a = ca.zeros(1000, manager=debug_m)
    b = ca.ones(1000, manager=debug_m)
    with ca.writable(b) as w:
        w = w[:]                                     # made inside: NumPy cannot close it
    ca.unsafe_free(a)
    assert debug_m.defrag("fast") == 1               # b slides down over a's block
    w[-1] = 5.0
    with pytest.raises(CachedArraysError, match=f"object {b.object.id} .* moved by defrag"):
        debug_m.check()
    assert float(b.sum()) == 1000.0


def test_debug_mode_does_not_fire_for_legal_use(debug_m):
    rng = np.random.default_rng(1)
    pick = random.Random(1)
    arrs = [ca.asarray(rng.random(int(rng.integers(1, 20000))), manager=debug_m)
            for _ in range(40)]
    for step in range(300):
        j = pick.randrange(len(arrs))
        a = arrs[j]
        op = pick.random()
        if op < 0.2:
            ca.evict(a)
        elif op < 0.4:
            ca.prefetch(a, force=True)
        elif op < 0.55:
            with ca.writable(a) as v:
                v += 1.0
        elif op < 0.65:
            with ca.access((a,), (arrs[j - 1],)) as (r, w):
                w[: min(r.size, w.size)] = r[: min(r.size, w.size)]
        elif op < 0.75:
            arrs[j] = ca.asarray(rng.random(int(rng.integers(1, 20000))), manager=debug_m)
        elif op < 0.85:
            b = a * 2.0 + 1.0
            a[: a.size // 2] = b[: a.size // 2]
        elif op < 0.9:
            ca.unsafe_free(a)
            arrs[j] = ca.zeros(int(rng.integers(1, 20000)), manager=debug_m)
        else:
            debug_m.defrag("fast")
        if step % 25 == 0:
            debug_m.check()
    debug_m.check()
    assert stale_writes(debug_m) == 0
    assert debug_m.stats()["moved"]["fast->slow"]["copies"] > 20   # the memory really was reused


def test_debug_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("CACHEDARRAYS_DEBUG", "1")
    with ca.Manager(fast="1MiB", slow="16MiB") as m:
        x = ca.zeros(100, manager=m)
        with ca.writable(x) as w:
            w = w[:]                                 # made inside: NumPy cannot close it
        ca.evict(x)
        w[0] = 1.0
        with pytest.raises(CachedArraysError, match=f"object {x.object.id} "):
            m.check()
    with ca.Manager(fast="1MiB", slow="16MiB", debug=False) as m:   # the argument wins
        x = ca.zeros(100, manager=m)
        with ca.writable(x) as w:
            w = w[:]                                 # made inside: NumPy cannot close it
        ca.evict(x)
        w[0] = 1.0
        m.check()
        assert stale_writes(m) == 0


@pytest.mark.parametrize("flag", ["off", "no", "0", "", 2, -1, 0.0, [], object()])
def test_a_debug_flag_that_is_not_a_bool_is_refused_not_guessed(flag):
    with pytest.raises(TypeError, match="debug must be True, False or None"):
        ca.Manager(fast="1MiB", slow="16MiB", debug=flag)


@pytest.mark.parametrize("value, on", [("1", True), (" ON ", True), ("yes", True),
                                       ("0", False), ("off", False), ("", False),
                                       ("2", None), ("enable", None), ("nein", None)])
def test_debug_from_the_environment_is_on_off_or_refused(monkeypatch, value, on):
    monkeypatch.setenv("CACHEDARRAYS_DEBUG", value)
    if on is None:
        with pytest.raises(ValueError, match="CACHEDARRAYS_DEBUG"):
            ca.Manager(fast="1MiB", slow="16MiB")
        return
    with ca.Manager(fast="1MiB", slow="16MiB") as m:
        assert (m._debug is not None) is on
