"""Devices: size parsing, the embedded temporary-file default, paths, room checks, DAX notes."""

import logging
import os

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import devices
from cachedarrays.errors import DeviceError, OutOfMemoryError


@pytest.mark.parametrize("text,expected", [
    ("256MiB", 256 << 20), ("4GiB", 4 << 30), ("1.5G", 3 << 29), ("100MB", 10**8),
    ("64k", 64 << 10), ("1024", 1024), (4096, 4096), ("0", 0), (" 2 KiB ", 2048),
])
def test_parse_size(text, expected):
    assert ca.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "12XB", "1.2.3G", "-5MiB"])
def test_bad_sizes_say_how_to_write_one(bad):
    with pytest.raises(ValueError, match="256MiB|negative"):
        ca.parse_size(bad)


def test_negative_and_wrong_types_are_refused():
    with pytest.raises(ValueError, match="negative"):
        ca.parse_size(-1)
    with pytest.raises(TypeError):
        ca.parse_size(True)
    with pytest.raises(TypeError):
        ca.parse_size([1])
    with pytest.raises(ValueError):
        ca.Manager(fast="huge", slow="1MiB")


def test_default_slow_device_is_a_removed_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dev = devices.SlowDevice("1MiB")
    assert dev.path.startswith(str(tmp_path))
    assert not os.path.exists(dev.path)          # removed at once; the mapping keeps it alive
    assert list(tmp_path.iterdir()) == []
    off = dev.alloc(1000, 1)
    a = np.ndarray((1000,), np.uint8, dev.buffer, off + 64)
    a[:] = 3
    assert a.sum() == 3000
    del a
    dev.close()
    dev.close()


def test_directory_path_gets_a_temporary_file_inside(tmp_path):
    dev = devices.SlowDevice("256KiB", path=str(tmp_path))
    assert os.path.dirname(dev.path) == str(tmp_path)
    assert list(tmp_path.iterdir()) == []
    dev.close()


def test_new_file_path_is_created_with_mode_0600_and_removed_at_close(tmp_path):
    p = tmp_path / "slow.heap"
    dev = devices.SlowDevice("256KiB", path=str(p))
    assert p.exists() and p.stat().st_size >= 256 << 10
    assert (p.stat().st_mode & 0o777) == 0o600
    dev.close()
    assert not p.exists()


def test_missing_directory_names_path_and_fix(tmp_path):
    bad = tmp_path / "nope" / "slow.heap"
    with pytest.raises(DeviceError, match="does not exist") as e:
        devices.SlowDevice("1MiB", path=str(bad))
    assert str(bad.parent) in str(e.value)


def test_unwritable_directory_is_reported(tmp_path, monkeypatch):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    if os.access(d, os.W_OK):          # root may write anywhere: act as an ordinary user would
        monkeypatch.setattr(devices.os, "access", lambda path, mode: False)
    with pytest.raises(DeviceError, match="not writable") as e:
        devices.SlowDevice("1MiB", path=str(d))
    assert str(d) in str(e.value) and "slow_path" in str(e.value)


def test_unwritable_file_is_reported(tmp_path, monkeypatch):
    p = tmp_path / "slow.heap"

    def deny(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(devices.os, "open", deny)
    with pytest.raises(DeviceError, match="Permission denied") as e:
        devices.SlowDevice("1MiB", path=str(p))
    assert str(p) in str(e.value) and "1.0 MiB" in str(e.value)


def test_file_system_without_room_is_refused_before_mapping(tmp_path, full_file_system):
    with pytest.raises(DeviceError, match="not enough room") as e:
        devices.SlowDevice("64MiB", path=str(tmp_path))
    assert "64.0 MiB" in str(e.value)
    assert list(tmp_path.iterdir()) == []        # nothing left behind


def test_not_dax_is_reported_once(tmp_path, caplog):
    p = tmp_path / "a.heap"
    with caplog.at_level(logging.INFO, logger="cachedarrays.devices"):
        devices.SlowDevice("64KiB", path=str(p)).close()
        devices.SlowDevice("64KiB", path=str(p)).close()
    notes = [r for r in caplog.records if "not DAX" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    assert "OS page cache" in notes[0].getMessage()


def test_dax_detection_reads_mount_options(monkeypatch):
    monkeypatch.setattr(devices, "_mount_options", lambda p: {"rw", "dax=always"})
    assert devices.is_dax("/anything")
    monkeypatch.setattr(devices, "_mount_options", lambda p: {"rw", "relatime"})
    assert not devices.is_dax("/anything")


def test_dram_options_and_numa_errors():
    d = devices.DRAM("1MiB", populate=True, hugepages=True)
    assert d.stats()["capacity"] == 1 << 20
    d.close()
    with pytest.raises(DeviceError, match="NUMA node 999"):
        devices.DRAM("1MiB", numa_node=999)


def test_dram_on_numa_node_zero_when_present():
    if not os.path.isdir("/sys/devices/system/node/node0"):
        pytest.skip("no NUMA information on this machine")
    try:
        d = devices.DRAM("1MiB", numa_node=0, populate=True)
    except DeviceError as e:
        pytest.skip(f"mbind not permitted here: {e}")
    assert d.stats()["capacity"] == 1 << 20
    a = np.ndarray((1 << 20,), np.uint8, d.buffer)
    a[:] = 7
    assert int(a.sum()) == 7 << 20
    if os.path.exists("/proc/self/numa_maps"):
        with open("/proc/self/numa_maps") as f:
            policy = [line.split()[1] for line in f if line.startswith(f"{d.address:x} ")]
        assert policy == ["bind:0"]               # the kernel placed the mapping on node 0
    del a
    d.close()


def test_size_zero_fast_device_sends_everything_to_slow(make_manager):
    m = make_manager(fast=0, slow="1MiB")
    x = ca.zeros(100, manager=m)
    assert x.device == "slow"
    assert m.stats()["events"].get("prefetch_refused", {}).get("count", 0) == 0
    ca.prefetch(x, force=True)
    assert x.device == "slow" and not ca.in_fast(x)
    assert m.stats()["events"]["prefetch_refused"]["count"] == 1
    with pytest.raises(OutOfMemoryError, match="no memory"):
        m.fast.alloc(10, 1)


def _managers_with_devices(tmp_path):
    """(manager, device names) for every way a manager gets its devices."""
    yield ca.Manager(fast="1MiB", slow="4MiB", slow_path=str(tmp_path / "slow.heap")), \
        ["fast", "slow"]
    yield ca.Manager(fast=ca.DRAM("1MiB"), slow=ca.SlowDevice("4MiB", path=str(tmp_path))), \
        ["fast", "slow"]
    yield ca.Manager(tiers=[("dram", "1MiB"), ("pmem", "2MiB"), ("ssd", "4MiB")]), \
        ["dram", "pmem", "ssd"]
    yield ca.Manager(fast="1MiB", slow="4MiB", virtual=True), ["fast", "slow"]


def test_a_device_of_an_open_manager_cannot_be_closed_under_it(tmp_path):
    for m, names in _managers_with_devices(tmp_path):
        virtual = m.devices[names[0]].virtual
        xs = [] if virtual else [ca.zeros(1000, manager=m) for _ in names]   # no data there
        for x, name in zip(xs, names):
            ca.evict(x, to=name) if name != names[0] else ca.prefetch(x)
        for name in names:
            dev = m.devices[name]
            with pytest.raises(DeviceError, match="open manager") as e:
                dev.close()
            assert repr(name) in str(e.value) and "close the manager" in str(e.value)
            assert not dev.closed and dev.heap is not None
        named = m.devices[names[1]].path
        if named == str(tmp_path / "slow.heap"):
            assert os.path.exists(named)     # still the device's file
        for x in xs:                         # the manager still works on every device
            assert float(x.sum()) == 0.0
            ca.unsafe_free(x)
        m.check()
        m.close()
        for name in names:
            assert m.devices[name].closed
            m.devices[name].close()          # closed with its manager: a no-op now
    assert os.listdir(tmp_path) == []
    dev = ca.DRAM("1MiB")                    # given back by a manager that failed: closable
    with pytest.raises(ValueError):
        ca.Manager(fast=dev, slow="1MiB", policy="no-such-policy")
    dev.close()
    assert dev.closed

