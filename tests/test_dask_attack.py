"""The dask integration under careless use: workers that share the client's process, a plugin
replaced while its chunks are persisted, slow paths every worker would share, options no worker
could use, workers whose memory distributed also manages, and chunks of every dtype and shape
(and headers that do not fit their frames) through distributed's serializer."""

import gc
import time
import weakref

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.errors import DeviceError

pytest.importorskip("distributed")
import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402
from distributed.protocol import deserialize, serialize  # noqa: E402

from cachedarrays.dask import ManagerPlugin  # noqa: E402

QUIET = dict(dashboard_address=None, scheduler_kwargs={"dashboard_address": "127.0.0.1:0"})


@pytest.fixture
def here():
    """The client process's default manager."""
    with ca.Manager(fast="8MiB", slow="64MiB") as m:
        previous = ca.set_default_manager(m)
        try:
            yield m
        finally:
            ca.set_default_manager(previous)


def _in_process(n_workers):
    return LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=False, **QUIET)


def _cached(shape=(400, 400), chunks=200):
    x = da.random.RandomState(7).random_sample(shape, chunks=chunks)
    return x, x.map_blocks(ca.asarray, meta=ca.empty((0, 0)))


def _wait_released(client, timeout=10):
    """Wait until the workers dropped every chunk the client let go."""
    end = time.monotonic() + timeout
    while any(client.run(lambda dask_worker: len(dask_worker.data)).values()):
        assert time.monotonic() < end, "the workers kept chunks the client let go"
        time.sleep(0.05)


def _plugin_managers(client):
    return client.run(lambda dask_worker: [
        p.manager for p in dask_worker.plugins.values() if isinstance(p, ManagerPlugin)])


def test_workers_in_the_clients_process_give_its_default_back_and_their_results_live_on(here):
    with _in_process(2) as cluster, Client(cluster) as c:
        c.register_plugin(ManagerPlugin(fast="2MiB", slow="16MiB"))
        managers = [weakref.ref(m) for ms in _plugin_managers(c).values() for m in ms]
        assert len({id(m()) for m in managers}) == 2
        x, xc = _cached()
        a = x.compute()
        got = (xc + 1).sum(axis=0).compute()
        persisted = (xc * 2).persist()
    # the default before the workers is back, whatever order they stopped in
    assert ca.default_manager() is here and not here.closed
    assert isinstance(got, ca.CachedArray) and not got.manager.closed
    with ca.readable(got) as g:                     # the result outlives the cluster
        np.testing.assert_allclose(g, (a + 1).sum(axis=0))
    del got, persisted, xc            # xc's meta: made while a worker's manager was the default
    gc.collect()
    assert [m() for m in managers] == [None, None]   # gone (and closed) with their last array


def test_a_replaced_plugin_keeps_the_persisted_chunks_of_its_manager(here):
    with _in_process(1) as cluster, Client(cluster) as c:
        c.register_plugin(ManagerPlugin(fast="2MiB", slow="16MiB"))
        x, xc = _cached()
        a = x.compute()
        persisted = (xc + 1).persist()
        (old,) = next(iter(_plugin_managers(c).values()))
        c.register_plugin(ManagerPlugin(fast="3MiB", slow="16MiB"))     # new sizes
        (new,) = next(iter(_plugin_managers(c).values()))
        assert new is not old and new.fast.size == 3 << 20 and not old.closed
        old = weakref.ref(old)
        got = (persisted * 2).sum(axis=0).compute()
        with ca.readable(got) as g:
            np.testing.assert_allclose(g, ((a + 1) * 2).sum(axis=0))
        del persisted, got
        _wait_released(c)
        c.unregister_worker_plugin(ManagerPlugin.name)
        assert new.closed and ca.default_manager() is here     # nothing of it in use
        del xc                                 # its meta was made while old was the default
        gc.collect()
        assert old() is None                   # gone (and closed) with its last chunk


@pytest.mark.parametrize("kind", ["file", "symlink", "devnull"])
def test_a_slow_path_every_worker_would_share_is_refused_before_the_cluster_sees_it(
        tmp_path, kind):
    path = {"file": tmp_path / "slow.bin", "symlink": tmp_path / "link",
            "devnull": "/dev/null"}[kind]
    if kind == "file":
        path.write_bytes(b"")
    elif kind == "symlink":
        path.symlink_to(tmp_path / "missing")         # a dangling link
    with pytest.raises(DeviceError, match="not a directory.*pass a directory"):
        ManagerPlugin(slow_path=path)
    with pytest.raises(TypeError, match="slow_path must be a directory"):
        ManagerPlugin(slow_path=3)


def test_a_new_file_name_as_slow_path_fails_on_every_worker_and_leaves_no_file(tmp_path, here):
    name = tmp_path / "slow.bin"
    with _in_process(2) as cluster, Client(cluster) as c:
        with pytest.raises(DeviceError, match="does not exist.*pass a directory"):
            c.register_plugin(ManagerPlugin(fast="1MiB", slow="4MiB", slow_path=name))
        assert all(ms == [None] for ms in _plugin_managers(c).values())   # none half set up
        assert not name.exists()
        c.register_plugin(ManagerPlugin(fast="1MiB", slow="4MiB", slow_path=tmp_path))
        managers = [m for ms in _plugin_managers(c).values() for m in ms]
        assert len({id(m) for m in managers}) == 2 and not any(m.closed for m in managers)
    assert all(m.closed for m in managers) and list(tmp_path.iterdir()) == []
    assert ca.default_manager() is here


STRUCTURED = np.dtype([("a", ">i4"), ("b", "<f8", (2,)), ("c", "S3")])


@pytest.mark.parametrize("dtype", [">i4", "<c8", "?", "M8[us]", "m8[s]", "U2", "V4",
                                   STRUCTURED, np.dtype([]), "V0"], ids=str)
@pytest.mark.parametrize("shape, view", [((4, 3), None), ((), None), ((0, 5), None),
                                         ((4, 3), "T"), ((12,), "step")])
def test_every_dtype_and_shape_travels_whole(here, dtype, shape, view):
    raw = (np.arange(int(np.prod(shape)) * np.dtype(dtype).itemsize) % 251).astype(np.uint8)
    a = np.ndarray(shape, dtype=dtype, buffer=raw)          # also dtypes of no bytes
    x = ca.asarray(a, manager=here)
    if view == "T":
        x, a = x.T, a.T
    elif view == "step":
        x, a = x[::3], a[::3]
    header, frames = serialize(x, serializers=["dask"])
    back = deserialize(header, frames)
    assert isinstance(back, ca.CachedArray) and back.manager is here
    assert back.dtype == a.dtype and back.shape == a.shape
    with ca.readable(back) as b:
        assert b.tobytes() == np.ascontiguousarray(a).tobytes()
    del frames
    gc.collect()
    assert not any(here.pinned(o) for o in here.objects())     # the send's pin let go


@pytest.mark.parametrize("args, kwargs, error, match", [
    (("manager",), {}, TypeError, "fast= is a Manager.*builds its own"),
    ((), {"slow": "manager"}, TypeError, "slow= is a Manager"),
    ((), {"bogus": 1}, TypeError, "unexpected keyword argument 'bogus'.*Manager's options"),
    ((), {"fast": "abc"}, ValueError, "fast memory size 'abc' is not a size"),
    ((), {"slow": -1}, ValueError, "slow memory size must not be negative"),
    ((), {"fast": 1.5}, ValueError, "whole number of bytes"),
], ids=["manager positional", "manager keyword", "unknown option", "bad size",
        "negative size", "fractional size"])
def test_options_no_worker_could_use_are_refused_on_the_client(here, args, kwargs, error,
                                                               match):
    args = tuple(here if a == "manager" else a for a in args)
    kwargs = {k: here if v == "manager" else v for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        ManagerPlugin(*args, **kwargs)


@pytest.mark.parametrize("given", ["new file", "~/slow.bin"])
def test_the_tiers_benchmark_refuses_a_slow_path_that_is_not_a_folder(tmp_path, monkeypatch,
                                                                      capsys, given):
    """A new file name: the slow device takes one, but every worker would share it (the
    --chunk no run could use fails the run at once should the folder check ever go)."""
    from helpers import load_benchmark
    monkeypatch.setenv("HOME", str(tmp_path))
    path = str(tmp_path / "slow.bin") if given == "new file" else given
    with pytest.raises(SystemExit) as exit_:
        load_benchmark("dask_tiers").main(["--slow-path", path, "--chunk", "1GiB",
                                           "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--slow-path '{tmp_path / 'slow.bin'}' is not a folder" in err   # ~ expanded
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("shape, match", [
    ([-1, -4], "shape \\[-1, -4\\] in its header, not a list of lengths >= 0"),
    ([True, 4], "not a list of lengths"),
    ("ab", "not a list of lengths"),
    ([2 ** 62, 4], "arrived with 32 bytes, not 147573952589676412928"),   # no int64 overflow
    ([2 ** 64, 0], "arrived with 32 bytes, not 0"),
    ([3], "arrived with 32 bytes, not 24"),
])
def test_a_chunk_whose_header_does_not_fit_its_frame_is_refused_by_name(here, shape, match):
    header, frames = serialize(ca.asarray(np.arange(4.0), manager=here), serializers=["dask"])
    header["sub-header"] = dict(header["sub-header"], shape=shape)
    with pytest.raises(ValueError, match=match):
        deserialize(header, frames)


@pytest.mark.parametrize("limit", ["1GiB", 0])
def test_a_worker_whose_memory_distributed_also_manages_is_named_with_the_fix(here, caplog,
                                                                             limit):
    """distributed would pickle chunks out of the manager to its own spill folder."""
    caplog.set_level("WARNING", logger="cachedarrays.dask")
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, memory_limit=limit,
                      **QUIET) as cluster, Client(cluster) as c:
        c.register_plugin(ManagerPlugin(fast="1MiB", slow="4MiB"))
    said = [r.getMessage() for r in caplog.records if r.name == "cachedarrays.dask"]
    if limit:
        assert len(said) == 1 and "memory_limit=1073741824 bytes" in said[0]
        assert "start the workers with memory_limit=0" in said[0]
    else:
        assert said == []


def test_a_tier_path_every_worker_would_share_is_refused_as_slow_path_is(tmp_path, here):
    (tmp_path / "pmem.bin").write_bytes(b"")
    with pytest.raises(DeviceError, match="the path of tier 'pmem' .*is not a directory"):
        ManagerPlugin(tiers=[("dram", "1MiB"), ("pmem", "4MiB", tmp_path / "pmem.bin")])
    with pytest.raises(TypeError, match="tiers= takes \\(name, size\\[, path\\]\\) tuples"):
        ManagerPlugin(tiers=[("dram", "1MiB"), "pmem"])
    with _in_process(1) as cluster, Client(cluster) as c:
        with pytest.raises(DeviceError, match="the path of tier 'pmem' .*does not exist"):
            c.register_plugin(ManagerPlugin(
                tiers=[("dram", "1MiB"), ("pmem", "4MiB", tmp_path / "new.bin")]))
        c.register_plugin(ManagerPlugin(tiers=[("dram", "1MiB"), ("pmem", "4MiB", tmp_path)]))
        ((m,),) = _plugin_managers(c).values()
        assert list(m.devices) == ["dram", "pmem"]
    assert m.closed and sorted(p.name for p in tmp_path.iterdir()) == ["pmem.bin"]
