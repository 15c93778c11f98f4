"""N tiers: ``Manager(tiers=[...])``, moves between any two tiers, stale copies, telemetry per
link, the ``fast``/``slow`` aliases, and tier specs that are refused with the fix named."""

import os

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.errors import DeviceError


@pytest.fixture
def tiers(tmp_path):
    return [("dram", "256KiB"), ("pmem", "1MiB", str(tmp_path)), ("ssd", "4MiB", str(tmp_path))]


@pytest.fixture
def m3(tiers):
    with ca.Manager(tiers=tiers, granularity=256) as m:
        yield m
        m.check()


def values(x):
    with ca.readable(x) as v:
        return v.copy()


def test_three_tiers_names_aliases_and_profiles(m3, tmp_path):
    assert [d.name for d in m3.tiers] == ["dram", "pmem", "ssd"]
    assert m3.fast is m3.tiers[0] and m3.slow is m3.tiers[1]
    assert m3._device("fast") is m3.tiers[0] and m3._device("slow") is m3.tiers[1]
    assert list(m3.devices) == ["dram", "pmem", "ssd"]
    assert [d.profile for d in m3.tiers] == ["dram", "optane", "nvme-ssd"]
    assert os.listdir(tmp_path) == []               # private files: their names are gone
    x = ca.ones(100, manager=m3)
    assert x.device == "dram" and ca.in_fast(x)
    with pytest.raises(ValueError, match="unknown device 'hdd'.*dram, pmem, ssd"):
        ca.evict(x, to="hdd")
    assert x.device == "dram"


def test_every_move_keeps_the_data(m3):
    want = np.arange(2000, dtype=np.float64)
    x = ca.asarray(want, manager=m3)
    moves = ["ssd", "dram", "pmem", "ssd", "pmem", "dram", "ssd", "slow", "fast", "ssd", "dram"]
    for to in moves:
        if to in ("dram", "fast"):
            assert ca.prefetch(x) is None
        else:
            ca.evict(x, to=to)
        assert x.device == {"slow": "pmem", "fast": "dram"}.get(to, to)
        np.testing.assert_array_equal(values(x), want)
        m3.check()
    assert ca.in_fast(x)


def test_the_newest_data_wins_after_writes_on_every_tier(m3):
    """Write, then move across the three tiers; copies left behind on other tiers are stale
    and must be dropped, never read back."""
    want = np.zeros(1000)
    x = ca.asarray(want, manager=m3)
    rng = np.random.default_rng(3)
    for step in range(40):
        to = ["dram", "pmem", "ssd"][rng.integers(3)]
        if to == "dram":
            ca.prefetch(x)
        else:
            ca.evict(x, to=to)
        if rng.random() < 0.6:
            i = int(rng.integers(1000))
            x[i] = step + 1.0
            want[i] = step + 1.0
        np.testing.assert_array_equal(values(x), want)
        obj = x.object
        primary = obj.primary
        if not m3.isdirty(primary):                 # a clean primary: every copy is equal
            for r in obj.regions.values():
                np.testing.assert_array_equal(m3.ndarray(r, np.float64, (1000,)), want)
        if to != "dram":                            # a move drops copies made stale by a write
            assert len(obj.regions) <= 2
        m3.check()


def test_a_clean_copy_on_another_tier_is_reused(m3):
    x = ca.asarray(np.arange(1000.0), manager=m3)
    ca.evict(x, to="ssd")
    ca.prefetch(x)                                  # clean, linked to ssd
    assert set(x.object.regions) == {"dram", "ssd"}
    before = m3.stats()["moved"]
    ca.evict(x, to="ssd")                           # nothing to write back
    assert m3.stats()["moved"] == before
    assert m3.stats()["events"]["writebacks_elided"]["count"] == 1
    np.testing.assert_array_equal(values(x), np.arange(1000.0))


def test_telemetry_per_link_and_direction(m3):
    x = ca.asarray(np.arange(1000.0), manager=m3)   # 8000 bytes
    ca.evict(x, to="pmem")
    ca.evict(x, to="ssd")
    ca.prefetch(x)
    x[0] = 1.0
    ca.evict(x, to="ssd")
    ca.evict(x, to="pmem")
    moved = m3.stats()["moved"]
    assert moved == {"dram->pmem": {"bytes": 8000, "copies": 1},
                     "pmem->ssd": {"bytes": 8000, "copies": 1},
                     "ssd->dram": {"bytes": 8000, "copies": 1},
                     "dram->ssd": {"bytes": 8000, "copies": 1},
                     "ssd->pmem": {"bytes": 8000, "copies": 1}}
    devs = m3.stats()["devices"]
    assert set(devs) == {"dram", "pmem", "ssd"}


def test_pressure_spills_to_the_second_tier(m3):
    xs = [ca.full(10_000, float(i), manager=m3) for i in range(12)]   # 80 KB each, 256 KiB dram
    assert {x.device for x in xs} == {"dram", "pmem"}
    for i, x in enumerate(xs):
        assert (values(x) == i).all()


def test_the_two_tier_spelling_still_names_fast_and_slow():
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        assert [d.name for d in m.tiers] == ["fast", "slow"]
        x = ca.ones(10, manager=m)
        ca.evict(x, to="slow")
        assert x.device == "slow"


def test_virtual_tiers(tmp_path):
    with ca.Manager(tiers=[("dram", "1GiB"), ("pmem", "4GiB"), ("ssd", "64GiB")],
                    virtual=True) as m:
        assert all(d.virtual for d in m.tiers)
        obj = m.new_pinned(1 << 29)
        m.release((obj,))
        assert obj.device == "dram"
        m.evict(obj, "ssd")
        assert obj.device == "ssd"
        assert m.stats()["moved"]["dram->ssd"] == {"bytes": 1 << 29, "copies": 1}
        m.check()


# ---- refused specs --------------------------------------------------------------------------

def _spec(tmp_path, case):
    d = str(tmp_path)
    return {
        "one tier": [("dram", "1MiB")],
        "no tiers": [],
        "a string": "dram",
        "duplicate names": [("dram", "1MiB"), ("pmem", "1MiB"), ("pmem", "1MiB")],
        "path on the fast tier": [("dram", "1MiB", d), ("pmem", "1MiB")],
        "slow first": [("slow", "1MiB"), ("pmem", "1MiB")],
        "slow third": [("dram", "1MiB"), ("pmem", "1MiB"), ("slow", "1MiB")],
        "fast second": [("dram", "1MiB"), ("fast", "1MiB")],
        "bad size": [("dram", "lots"), ("pmem", "1MiB")],
        "negative size": [("dram", "1MiB"), ("pmem", -5)],
        "empty name": [("", "1MiB"), ("pmem", "1MiB")],
        "not a name": [(3, "1MiB"), ("pmem", "1MiB")],
        "too long": [("dram", "1MiB"), ("pmem", "1MiB", None, "optane", "x")],
        "a dict": [{"name": "dram"}, ("pmem", "1MiB")],
    }[case]


@pytest.mark.parametrize("case,match", [
    ("one tier", "at least two tiers"),
    ("no tiers", "at least two tiers"),
    ("a string", "at least two tiers"),
    ("duplicate names", "two tiers are named 'pmem'"),
    ("path on the fast tier", "takes no path"),
    ("slow first", "'slow' names tier 1"),
    ("slow third", "'slow' names tier 1"),
    ("fast second", "'fast' names tier 0"),
    ("bad size", "'lots' is not a size"),
    ("negative size", "must not be negative"),
    ("empty name", "non-empty string"),
    ("not a name", "non-empty string"),
    ("too long", "not a tier"),
    ("a dict", "not a tier"),
])
def test_bad_tier_specs_raise_value_error_naming_the_fix(tmp_path, case, match):
    with pytest.raises(ValueError, match=match) as e:
        ca.Manager(tiers=_spec(tmp_path, case))
    msg = str(e.value)
    assert "tier" in msg
    if case not in ("bad size", "negative size"):
        assert "e.g." in msg                    # the fix: a tier list that works
    assert os.listdir(tmp_path) == []


def test_fast_or_slow_given_with_tiers_is_refused(tmp_path):
    spec = [("dram", "1MiB"), ("pmem", "1MiB", str(tmp_path))]
    for kw in (dict(fast="1MiB"), dict(slow="1GiB"), dict(slow_path=str(tmp_path))):
        with pytest.raises(ValueError, match="tiers="):
            ca.Manager(tiers=spec, **kw)


@pytest.mark.parametrize("kind", ["existing file", "symlink to a file", "dangling symlink",
                                  "fifo", "char device", "missing directory"])
def test_hostile_tier_paths_are_refused_and_leave_nothing_behind(tmp_path, kind):
    d = tmp_path / "d"
    d.mkdir()
    target = d / "target"
    if kind == "existing file":
        target.write_bytes(b"precious")
        path = target
    elif kind == "symlink to a file":
        target.write_bytes(b"precious")
        path = d / "link"
        path.symlink_to(target)
    elif kind == "dangling symlink":
        path = d / "link"
        path.symlink_to(d / "nowhere")
    elif kind == "fifo":
        path = d / "fifo"
        os.mkfifo(path)
    elif kind == "char device":
        path = "/dev/null"
    else:
        path = d / "missing" / "file"
    before = sorted(os.listdir(d))
    new_file = d / "pmem.heap"
    with pytest.raises(DeviceError) as e:
        ca.Manager(tiers=[("dram", "1MiB"), ("pmem", "1MiB", str(new_file)),
                          ("ssd", "1MiB", str(path))])
    assert str(path) in str(e.value) and "tiers[2] ('ssd')" in str(e.value)
    assert sorted(os.listdir(d)) == before           # the pmem file made first was removed
    if kind in ("existing file", "symlink to a file"):
        assert target.read_bytes() == b"precious"


def test_a_symlink_to_a_directory_and_a_new_file_name_are_accepted(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with ca.Manager(tiers=[("dram", "1MiB"), ("pmem", "1MiB", str(tmp_path / "link")),
                           ("ssd", "1MiB", str(tmp_path / "ssd.heap"))]) as m:
        assert os.listdir(tmp_path / "real") == []       # a private file, name removed
        assert (tmp_path / "ssd.heap").exists()
        x = ca.ones(100, manager=m)
        ca.evict(x, to="ssd")
        assert (values(x) == 1).all()
    assert not (tmp_path / "ssd.heap").exists()          # removed at close


def test_two_tiers_on_one_file_are_refused(tmp_path):
    p = str(tmp_path / "one.heap")
    with pytest.raises(DeviceError, match="one.heap"):
        ca.Manager(tiers=[("dram", "1MiB"), ("pmem", "1MiB", p), ("ssd", "1MiB", p)])
    assert os.listdir(tmp_path) == []


def test_an_unknown_tier_profile_is_refused_when_the_manager_is_made():
    """Profiles sit below the manager (cachedarrays.profiles): a bad name is refused at
    construction, naming it and the presets, not after a whole traced run."""
    before = ca.Manager.open_managers()
    with pytest.raises(ValueError, match="warp-drive.*optane"):
        ca.Manager(tiers=[("dram", "1MiB"), ("pmem", "1MiB", None, "warp-drive")])
    assert ca.Manager.open_managers() == before


def test_evict_with_the_tier_passed_positionally_is_refused(m3):
    x = ca.ones(100, manager=m3)
    with pytest.raises(TypeError, match=r"ca.evict\(x, to='ssd'\)"):
        ca.evict(x, "ssd")
    assert x.device == "dram"
