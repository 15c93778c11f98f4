"""Switches take True or False: a value that is merely truthy or falsy (the text "no", None, 2, an
array) raises a TypeError naming the switch, the value's type and the fix, before anything is
made or changed. NumPy's bools are bools."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import copyengine
from cachedarrays.models import cnn
from cachedarrays.models.dlrm import criteo as C
from cachedarrays.policies import MemoryMode
from cachedarrays.policies.memorymode import MemoryModeCache

BAD = ["no", "False", None, 2, 0.0, [True], np.array([1, 2])]
BAD_IDS = ["str-no", "str-False", "None", "int-2", "float-0", "list", "ndarray"]
SIZES = [7, 1000, 3] + [50] * 23


def _refused(call, name, bad):
    with pytest.raises(TypeError, match=rf"{name}=.* must be True or False, not "
                                        rf"{type(bad).__name__}; write {name}=True"):
        call(bad)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("criteo")
    tsv = C.write_tiny_criteo(d / "tiny.tsv", nrows=40, seed=2)
    C.convert_criteo(tsv, d / "out", SIZES)
    return d / "out"


@pytest.fixture(scope="module")
def session():
    model = cnn.build("vgg", 11, batch=2, image=8, classes=4, width=16)
    m, s = cnn.make_session("LM", fast="256KiB", slow="32MiB")
    model.init(s, seed=0)
    x, y = cnn.synthetic_batch(model)
    yield m, s, model, x, y
    m.close()


# ---- the devices, the manager and the copy engine ----------------------------------------------

DEVICE_CALLS = {
    "Manager populate": (lambda v: ca.Manager(fast="64KiB", slow="1MiB", populate=v), "populate"),
    "Manager hugepages": (lambda v: ca.Manager(fast="64KiB", slow="1MiB", hugepages=v),
                          "hugepages"),
    "Manager virtual": (lambda v: ca.Manager(fast="64KiB", slow="1MiB", virtual=v), "virtual"),
    "Manager tiers populate": (lambda v: ca.Manager(tiers=[("dram", "64KiB"), ("pmem", "1MiB")],
                                                    populate=v), "populate"),
    "DRAM populate": (lambda v: ca.DRAM("64KiB", populate=v), "populate"),
    "DRAM hugepages": (lambda v: ca.DRAM("64KiB", hugepages=v), "hugepages"),
    "SlowDevice populate": (lambda v: ca.SlowDevice("1MiB", populate=v), "populate"),
}


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("which", sorted(DEVICE_CALLS))
def test_device_and_manager_switches_refuse_non_booleans(which, bad):
    call, name = DEVICE_CALLS[which]
    _refused(call, name, bad)
    for good in (np.bool_(True), False):          # NumPy's bools are bools
        call(good).close()


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_copy_persist_refuses_non_booleans(bad):
    src, dst = np.arange(16, dtype=np.uint8), np.zeros(16, dtype=np.uint8)
    _refused(lambda v: copyengine.copy(dst.ctypes.data, src.ctypes.data, 16, persist=v),
             "persist", bad)
    assert not dst.any()
    workers = copyengine.CopyWorkers()
    try:
        _refused(lambda v: workers.submit("a->b", dst.ctypes.data, src.ctypes.data, 16,
                                          persist=v), "persist", bad)
        _refused(lambda v: workers.shutdown(cancel=v), "cancel", bad)
    finally:
        workers.shutdown()
    assert not dst.any()
    copyengine.copy(dst.ctypes.data, src.ctypes.data, 16, persist=np.bool_(False))
    assert (dst == src).all()


MANAGER_CALLS = {
    "pin detached": lambda m, o, v: m.pin(o, detached=v),
    "unpin detached": lambda m, o, v: m.unpin(o, detached=v),
    "prefetch force": lambda m, o, v: m.prefetch(o, force=v),
    "prefetch wait": lambda m, o, v: m.prefetch(o, wait=v),
    "evict wait": lambda m, o, v: m.evict(o, wait=v),
    "run short": lambda m, o, v: m.run(lambda new: None, (o,), (), short=v),
    "drop annotation": lambda m, o, v: m.drop(o, annotation=v),
    "regenerate annotation": lambda m, o, v: m.regenerate(o, annotation=v),
    "copyto wait": lambda m, o, v: m.copyto(m.primary(o), m.primary(o), wait=v),
}


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("which", sorted(MANAGER_CALLS))
def test_manager_calls_refuse_non_boolean_switches_and_change_nothing(m, which, bad):
    x = ca.full(100, 1.0, manager=m)
    o = x.object
    where, moved = x.device, m.stats()["moved"]
    _refused(lambda v: MANAGER_CALLS[which](m, o, v), which.split()[1], bad)
    assert x.device == where and m.stats()["moved"] == moved
    assert m.pin_count(o) == 0 and not o.dropped


# ---- policies ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("name", ["write_nofill", "cleanup"])
def test_memorymode_switches_refuse_non_booleans(name, bad):
    _refused(lambda v: MemoryMode(**{name: v}), name, bad)
    if name == "write_nofill":
        _refused(lambda v: MemoryModeCache(4096, write_nofill=v), name, bad)


# ---- the CNN model -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_session_annotations_refuses_non_booleans(m, bad):
    _refused(lambda v: cnn.Session(m, annotations=v), "annotations", bad)
    assert cnn.Session(m, annotations=np.bool_(False)).annotations is False


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("name", ["annotations", "stable_ids"])
def test_make_session_switches_refuse_non_booleans(name, bad):
    _refused(lambda v: cnn.make_session("LM", "256KiB", "4MiB", **{name: v}), name, bad)


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("name", ["defrag", "fused"])
def test_train_step_switches_refuse_non_booleans_before_any_weight_changes(session, name, bad):
    m, s, model, x, y = session
    before = model.weights()
    _refused(lambda v: cnn.train_step(s, model, x, y, cnn.SGD(0.1), **{name: v}), name, bad)
    after = model.weights()
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_trainer_and_reference_fused_refuse_non_booleans(bad):
    _refused(lambda v: cnn.Trainer("vgg", 11, fast="1MiB", fused=v), "fused", bad)
    _refused(lambda v: cnn.fast_only_reference("vgg", 11, fused=v), "fused", bad)


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("layer", ["Conv2d", "Dense"])
@pytest.mark.parametrize("name", ["bias", "need_dx"])
def test_layer_switches_refuse_non_booleans(layer, name, bad):
    make = {"Conv2d": lambda **kw: cnn.Conv2d("c", (2, 3, 8, 8), 4, 3, **kw),
            "Dense": lambda **kw: cnn.Dense("d", (2, 5), 4, **kw)}[layer]
    _refused(lambda v: make(**{name: v}), name, bad)


# ---- the DLRM data -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_criteo_dataset_drop_last_refuses_non_booleans(converted, bad):
    _refused(lambda v: C.CriteoDataset(converted, 7, drop_last=v), "drop_last", bad)
    assert len(C.CriteoDataset(converted, 7, drop_last=np.bool_(False))) == 6
    assert len(C.CriteoDataset(converted, 7, drop_last=True)) == 5
