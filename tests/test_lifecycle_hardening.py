"""A manager's life at its edges: virtual devices hold no data (every view of it is refused,
and a manager never mixes them with real ones), close() called from code that a call on the
manager's arrays calls back refuses at once, and a manager dropped without close() is closed
as soon as its last reference goes."""

import gc
import re
import threading
import time
import weakref

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.errors import DeviceError, PinnedError


# ---- virtual devices hold no data --------------------------------------------------------------

@pytest.fixture
def vm():
    with ca.Manager(fast="1MiB", slow="4MiB", virtual=True) as mgr:
        yield mgr


ACCESSES = {
    "np.asarray": lambda x: np.asarray(x),
    "ufunc": lambda x: x + 1.0,
    "ufunc into": lambda x: np.add(x, 1.0, out=x),
    "function": lambda x: np.sum(x),
    "indexing": lambda x: x[0],
    "assignment": lambda x: x.__setitem__(0, 1.0),
    "fill": lambda x: x.fill(1.0),
    "readable": lambda x: ca.readable(x).__enter__(),
    "writable": lambda x: ca.writable(x).__enter__(),
    "kernel": lambda x: ca.kernel("k", reads=(x,)).__enter__(),
    "tolist": lambda x: x.tolist(),
}


@pytest.mark.parametrize("where", ["fast", "evicted", "prefetched"])
@pytest.mark.parametrize("access", sorted(ACCESSES))
def test_every_read_or_write_of_an_array_on_a_virtual_device_is_refused(vm, where, access):
    x = _virtual_array(vm, 1000)
    if where != "fast":
        ca.evict(x)
        assert x.device == "slow"
    if where == "prefetched":
        ca.prefetch(x)
        assert x.device == "fast"
    with pytest.raises(DeviceError, match=r"object \d+ \(7\.8 KiB\) is on virtual device "
                                          r"'(fast|slow)', which holds no data"):
        ACCESSES[access](x)
    assert not vm.pinned(x._obj)                # the refused use left nothing pinned


def _virtual_array(m, n):
    """A float64 CachedArray of n elements over a new object of the virtual manager m (what a
    replay makes: an object, with no data written)."""
    obj = m.new_pinned(8 * n)
    m.release((obj,))
    return ca.CachedArray._make(obj, m, (n,), np.dtype(np.float64), (8,), 0)


@pytest.mark.parametrize("make", [lambda m: ca.asarray(np.arange(5.0), manager=m),
                                  lambda m: ca.zeros(5, manager=m),
                                  lambda m: ca.empty(5, manager=m)],
                         ids=["asarray", "zeros", "empty"])
def test_making_arrays_on_a_virtual_manager_is_refused(vm, make):
    with pytest.raises(DeviceError, match="holds no data"):
        make(vm)


# every way of making an array with data: none may leave an array on a virtual manager
_MAKERS = {
    "empty": lambda m, x: ca.empty(5, manager=m),
    "empty slow": lambda m, x: ca.empty(5, manager=m, placement="slow"),
    "empty fast": lambda m, x: ca.empty(5, manager=m, placement="fast"),
    "empty F": lambda m, x: ca.empty((2, 3), order="F", manager=m),
    "zeros F": lambda m, x: ca.zeros((2, 3), order="F", manager=m),
    "ones": lambda m, x: ca.ones(5, manager=m),
    "full": lambda m, x: ca.full(5, 2.0, manager=m),
    "array": lambda m, x: ca.array([1.0, 2.0], manager=m),
    "asarray slow": lambda m, x: ca.asarray(np.arange(3.0), manager=m, placement="slow"),
    "empty_like": lambda m, x: ca.empty_like(x),
    "np.zeros_like": lambda m, x: np.zeros_like(x),
    "like=": lambda m, x: np.zeros(3, like=x),
    "copy": lambda m, x: x.copy(),
    "astype": lambda m, x: x.astype(np.float32),
}


@pytest.mark.parametrize("make", sorted(_MAKERS))
def test_every_way_of_making_an_array_on_a_virtual_manager_is_refused_alike(vm, make):
    x = _virtual_array(vm, 10)
    before = vm.stats()
    with pytest.raises(DeviceError, match=r"cannot be made on .*virtual \(Manager\(\.\.\., "
                                          r"virtual=True\)\), which holds no data.*replayed; "
                                          r"make arrays on a Manager without virtual=True"):
        _MAKERS[make](vm, x)
    assert [o.id for o in vm.objects()] == [x._obj.id]    # nothing was allocated
    assert vm.stats() == before
    vm.check()
    assert ca.empty((0, 3), manager=vm).shape == (0, 3)     # an empty one holds no data


def test_repr_of_an_array_on_a_virtual_device_describes_it(vm):
    # a repr that raises breaks debuggers and logging; the data is refused, not the description
    x = _virtual_array(vm, 10)
    assert repr(x) == "CachedArray(<no data: on virtual device 'fast'>, shape=(10,), " \
        "dtype=float64)"
    ca.evict(x)
    assert "virtual device 'slow'" in repr(x[2:])
    with pytest.raises(DeviceError, match="holds no data"):
        str(x)


def test_placement_works_on_a_virtual_manager(vm):
    x = _virtual_array(vm, 100)
    ca.evict(x)
    assert x.device == "slow"
    ca.prefetch(x)
    assert x.device == "fast" and x.shape == (100,)


@pytest.mark.parametrize("make", [
    lambda: dict(fast="1MiB", slow=ca.VirtualDevice("4MiB", name="slow")),
    lambda: dict(fast=ca.VirtualDevice("1MiB"), slow="4MiB"),
    lambda: dict(fast=ca.DRAM("1MiB"), slow="4MiB", virtual=True),
    lambda: dict(tiers=[("dram", "1MiB"), ca.VirtualDevice("4MiB", name="pmem")]),
], ids=["virtual slow", "virtual fast", "real fast in a virtual manager", "virtual tier"])
def test_a_manager_mixing_virtual_and_real_devices_is_refused(make):
    kwargs = make()
    given = [d for d in (*kwargs.get("tiers", ()), kwargs.get("fast"), kwargs.get("slow"))
             if isinstance(d, ca.Device)]
    before = len(ca.Manager.open_managers())
    with pytest.raises(DeviceError, match=r"mix virtual and real memory: .*make every device "
                                          r"virtual .* or none"):
        ca.Manager(**kwargs)
    assert len(ca.Manager.open_managers()) == before
    for d in given:                             # a device given stays the caller's, usable
        assert not d.closed
        with ca.Manager(**({"fast": d, "slow": ca.VirtualDevice("4MiB", name="slow")}
                           if d.virtual and d.name != "slow" else
                           {"fast": ca.VirtualDevice("1MiB"), "slow": d} if d.virtual else
                           {"fast": d, "slow": "4MiB"})):
            pass


def test_replay_still_runs_on_virtual_devices():
    with ca.Manager(fast="1MiB", slow="16MiB") as m:
        w = ca.asarray(np.ones(4096), manager=m)
        with ca.trace(m) as t:
            for _ in range(2):
                h = np.tanh(w)
                del h
                ca.mark_step(m)
    assert ca.replay(t, "lru", fast=0.5).last.time > 0


# ---- close() from a callback of a call on the manager's arrays ----------------------------------

def _close_inside(m, call):
    """Run call(close) where close is m.close(timeout=5); (error, seconds) of the close."""
    got = []

    def close():
        if got:
            return
        t = time.monotonic()
        try:
            m.close(timeout=5.0)
            got.append((None, time.monotonic() - t))
        except PinnedError as e:
            got.append((e, time.monotonic() - t))

    call(close)
    return got[0]


def _along_axis(m, close):
    x = ca.asarray(np.ones((3, 4)), manager=m)
    np.apply_along_axis(lambda row: (close(), row.sum())[1], 1, x)
    return x


def _along_axis_big(m, close):                  # beyond the short-call size
    x = ca.asarray(np.ones((4, 100_000)), manager=m)
    np.apply_along_axis(lambda row: (close(), row[0])[1], 1, x)
    return x


def _manager_run(short):
    def call(m, close):
        x = ca.asarray(np.ones(8), manager=m)
        m.run(lambda new: close(), (x._obj,), (), 64, "k", short)
        return x
    return call


def _frompyfunc(m, close):
    x = ca.asarray(np.ones(3), manager=m)
    np.frompyfunc(lambda v: (close(), v)[1], 1, 1)(x)
    return x


def _frompyfunc_out(m, close):
    x = ca.asarray(np.ones(3), manager=m)
    out = ca.empty(3, manager=m)
    np.frompyfunc(lambda v: (close(), v)[1], 1, 1)(x, out=out, casting="unsafe")
    return x


def _with_out(m, close):                        # the general path (acquire and release)
    x = ca.asarray(np.ones((3, 4)), manager=m)
    out = ca.empty(3, manager=m)
    np.apply_over_axes(lambda a, ax: (close(), np.sum(a, ax, keepdims=True))[1], x, [1])
    np.sum(x, axis=1, out=out)
    return x


CALLBACKS = {
    "np.apply_along_axis": _along_axis,
    "np.apply_along_axis, large": _along_axis_big,
    "Manager.run, short": _manager_run(True),
    "Manager.run": _manager_run(False),
    "ufunc from a Python function": _frompyfunc,
    "ufunc from a Python function, out=": _frompyfunc_out,
    "np.apply_over_axes": _with_out,
}


@pytest.mark.parametrize("name", sorted(CALLBACKS))
def test_close_inside_a_callback_of_a_call_on_its_arrays_refuses_at_once(name):
    m = ca.Manager(fast="8MiB", slow="16MiB")
    try:
        held = []
        err, seconds = _close_inside(m, lambda close: held.append(CALLBACKS[name](m, close)))
        assert isinstance(err, PinnedError), err
        assert seconds < 2.0
        assert "calling thread" in str(err) and "other threads" not in str(err)
        assert re.search(r"object \d+ \(", str(err))
        assert not m.closed                     # it stays open and usable
        x = held[0]
        assert float(np.asarray(x + 0).ravel()[0]) == 1.0
        assert not m.pinned(x._obj)
    finally:
        m.close()
    assert m.closed


def test_close_still_waits_for_a_kernel_of_another_thread():
    m = ca.Manager(fast="1MiB", slow="4MiB")
    x = ca.asarray(np.ones((3, 4)), manager=m)
    inside, leave = threading.Event(), threading.Event()

    def row(r):
        inside.set()
        leave.wait(10)
        return r.sum()

    t = threading.Thread(target=np.apply_along_axis, args=(row, 1, x))
    t.start()
    inside.wait(10)
    threading.Timer(0.3, leave.set).start()
    start = time.monotonic()
    m.close(timeout=10.0)                       # waits for the other thread's kernel
    assert m.closed and time.monotonic() - start >= 0.2
    t.join(10)


# ---- a dropped manager closes at once ----------------------------------------------------------

POLICIES = [
    dict(policy="lru"), dict(policy="lru", policy_options=dict(lookahead=2)),
    dict(policy="lru", policy_options=dict(write_allocate=True)), dict(policy="fastonly"),
    dict(policy="checkpoint"), dict(policy="memorymode"), dict(policy="firsttouch"),
    dict(policy="sentinel"), dict(policy="capuchin"), dict(policy="deeptm"),
    dict(policy="autotm"), dict(policy="uvm"), dict(policy="flashneuron"),
    dict(policy="g10", tiers=[("dram", "1MiB"), ("pmem", "4MiB"), ("ssd", "8MiB")]),
]


@pytest.mark.parametrize("options", POLICIES, ids=lambda o: f"{o['policy']}"
                         f"{'-' + '-'.join(o['policy_options']) if 'policy_options' in o else ''}")
def test_a_manager_dropped_without_close_is_closed_without_the_collector(options):
    def work():
        kw = dict(options) if "tiers" in options else dict(fast="1MiB", slow="4MiB", **options)
        m = ca.Manager(**kw)
        x = ca.asarray(np.ones(1000), manager=m)
        for _ in range(2):
            y = x * 2.0
            with ca.kernel("k", reads=(x,), writes=(y,)) as (a, o):
                o += a
            del y
            ca.mark_step(m)
        del x
        return weakref.ref(m), list(m.tiers)

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        ref, devices = work()
        assert ref() is None
        assert all(d.closed for d in devices)
    finally:
        if enabled:
            gc.enable()


def test_twenty_dropped_managers_hold_no_devices():
    enabled = gc.isenabled()
    gc.disable()
    try:
        devices = []
        for _ in range(20):
            m = ca.Manager(fast="4MiB", slow="16MiB")
            float(ca.asarray(np.ones(1000), manager=m).sum())
            devices += m.tiers
            del m
        assert all(d.closed for d in devices)
    finally:
        if enabled:
            gc.enable()

