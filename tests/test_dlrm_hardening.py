"""DLRM under hostile use: configs with bad sizes, interaction kernels given the wrong arrays,
flush targets that are not row counts, labels and dense inputs out of range, state dicts that
do not fit, and table kinds that must train bit for bit alike."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import cachedarrays as ca
from cachedarrays.models.dlrm import CachedEmbeddingTable, DLRM, configs, synthetic_dataset
from cachedarrays.models.dlrm._head import output_layer_backward
from cachedarrays.models.dlrm.model import (bce_with_logits, dot_interaction,
                                            dot_interaction_backward)

KINDS = ("fast", "simple", "static", "dynamic")


@pytest.fixture(scope="module")
def m():
    with ca.Manager(fast="64MiB", slow="256MiB") as manager:
        yield manager


def _same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---- configs ---------------------------------------------------------------------------------

GOOD = dict(name="c", table_sizes=(10, 20), featuresize=4, bottom=(8, 4), top=(8, 1),
            batch_size=16)


@pytest.mark.parametrize("field, value, error", [
    ("featuresize", 0, ValueError), ("featuresize", -4, ValueError),
    ("featuresize", True, TypeError), ("featuresize", "4", TypeError),
    ("table_sizes", (10.5,), TypeError), ("table_sizes", (True, 3), TypeError),
    ("table_sizes", (0,), ValueError), ("table_sizes", (), ValueError),
    ("table_sizes", "ab", TypeError), ("table_sizes", 5, TypeError),
    ("bottom", (0, 4), ValueError), ("bottom", (-3, 4), ValueError),
    ("bottom", (8.5, 4), TypeError), ("bottom", (), ValueError),
    ("top", (0, 1), ValueError), ("top", (-1, 1), ValueError), ("top", (True,), TypeError),
    ("batch_size", 0, ValueError), ("batch_size", -1, ValueError),
    ("batch_size", 1.5, TypeError), ("batch_size", None, TypeError),
    ("dense_features", 0, ValueError), ("dense_features", 2.5, TypeError),
    ("bag_size", 0, ValueError), ("bag_size", -1, ValueError),
    ("lr", float("nan"), ValueError), ("lr", float("inf"), ValueError), ("lr", -1, ValueError),
    ("lr", "0.1", TypeError), ("lr", True, TypeError),
    ("name", None, TypeError),
])
def test_a_config_refuses_sizes_that_are_not_positive_integers(field, value, error):
    args = dict(GOOD, **{field: value})
    if field == "featuresize":
        args["bottom"] = (8, value)
    with pytest.raises(error, match=field if field != "name" else "name must be a string"):
        configs.DLRMConfig(**args)


def test_a_config_takes_lists_and_integral_floats_as_tuples_of_ints():
    cfg = configs.DLRMConfig("c", [10, 20.0], 4.0, [8, 4], [8, 1], 16.0)
    assert cfg.table_sizes == (10, 20) and cfg.bottom == (8, 4) and cfg.top == (8, 1)
    assert all(type(v) is int for v in cfg.table_sizes + (cfg.featuresize, cfg.batch_size))
    assert cfg == configs.DLRMConfig(**GOOD) and hash(cfg) == hash(configs.DLRMConfig(**GOOD))


@pytest.mark.parametrize("kw, error", [
    (dict(scale=0), ValueError), (dict(scale=-1), ValueError),
    (dict(scale=float("nan")), ValueError), (dict(scale="1"), TypeError),
    (dict(scale=True), TypeError), (dict(width_scale=0), ValueError),
    (dict(width_scale=float("inf")), ValueError),
])
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_config_factories_refuse_a_scale_that_is_not_a_positive_number(name, kw, error):
    with pytest.raises(error, match=next(iter(kw))):
        configs.get_config(name, **kw)


# ---- interaction kernels and the output layer ----------------------------------------------

def _t(b=4, nfeat=3, fs=2, dtype=np.float32):
    return np.random.default_rng(0).random((b, nfeat * fs)).astype(dtype)


@pytest.mark.parametrize("case, error", [
    ("out narrower", "out must be"), ("out fewer rows", "out must be"),
    ("out int", "out must be"), ("out aliases t", "shares memory"),
    ("out read-only", "read-only"), ("t too narrow", "t has shape"),
    ("t int", "float32 or float64"), ("nfeat 0", "nfeat must be"),
    ("fs -1", "fs must be"), ("nfeat bool", "nfeat must be"),
])
def test_dot_interaction_refuses_arrays_that_do_not_fit(case, error):
    t = _t()
    args = {"out narrower": (t, 3, 2, np.empty((4, 2), np.float32)),
            "out fewer rows": (t, 3, 2, np.empty((1, 5), np.float32)),
            "out int": (t, 3, 2, np.empty((4, 5), np.int64)),
            "out aliases t": (t, 3, 2, t[:, :5]),
            "out read-only": (t, 3, 2, np.broadcast_to(np.float32(0), (4, 5))),
            "t too narrow": (t, 5, 2, None),
            "t int": (t.astype(np.int64), 3, 2, None),
            "nfeat 0": (t, 0, 2, None), "fs -1": (t, 3, -1, None),
            "nfeat bool": (t, True, 2, None)}[case]
    before = t.copy()
    with pytest.raises((ValueError, TypeError), match=error):
        dot_interaction(*args)
    assert np.array_equal(t, before)


@pytest.mark.parametrize("case, error", [
    ("dt narrower", "dt must be"), ("dr narrower", "dr must be"),
    ("dt is t", "dt shares memory"), ("dt is dr", "dt shares memory"),
    ("dr fewer rows", "dr must be"), ("t too wide", "t has shape"),
])
def test_dot_interaction_backward_refuses_arrays_that_do_not_fit(case, error):
    t = _t()
    dr = np.ones((4, 5), np.float32)
    wide = np.ones((4, 6), np.float32)
    args = {"dt narrower": (t, dr, 3, 2, np.empty((4, 2), np.float32)),
            "dr narrower": (t, dr[:, :2], 3, 2, None),
            "dt is t": (t, dr, 3, 2, t),
            "dt is dr": (t, wide[:, :5], 3, 2, wide),
            "dr fewer rows": (t, dr[:1], 3, 2, None),
            "t too wide": (_t(fs=3), dr, 3, 2, None)}[case]
    before = t.copy()
    with pytest.raises(ValueError, match=error):
        dot_interaction_backward(*args)
    assert np.array_equal(t, before)


def test_bce_refuses_labels_that_do_not_match_the_logits():
    with pytest.raises(ValueError, match="3 labels for 4 logits"):
        bce_with_logits(np.zeros((4, 1)), np.zeros(3))


def test_output_layer_backward_refuses_outputs_that_overlap():
    n, h = 5, 3
    r = np.random.default_rng(0)
    dz, y, w = (r.random(s, dtype=np.float32) for s in ((n, 1), (n, h), (1, h)))
    dx, db = np.empty((n, h), np.float32), np.empty(1, np.float32)
    shared = np.empty(h, np.float32)
    with pytest.raises(ValueError, match="dbp shares memory with dw"):
        output_layer_backward(dz, y, w, dx, shared.reshape(1, h), db, shared)
    with pytest.raises(ValueError, match="y must be a"):
        output_layer_backward(dz, np.ones(h, np.float32), w, dx, shared.reshape(1, h), db,
                              np.empty(h, np.float32))


# ---- a cached table's flush target ---------------------------------------------------------

@pytest.mark.parametrize("target, error", [
    (float("nan"), TypeError), (2.5, TypeError), (True, TypeError), ("3", TypeError),
    ([3], TypeError), (-1, ValueError), (np.int64(-5), ValueError),
])
@pytest.mark.parametrize("flush", ["flush_dirty", "flush_clean"])
def test_a_flush_target_must_be_a_row_count(m, flush, target, error):
    t = CachedEmbeddingTable(100, 4, manager=m, cachelower=0.2, cacheslack=0.1, page_rows=4)
    t.lookup(np.arange(30))
    before = (t.cached_rows, t.stats()["flushes"])
    with pytest.raises(error, match="target_rows"):
        getattr(t, flush)(target)
    assert (t.cached_rows, t.stats()["flushes"]) == before
    t.check()
    assert getattr(t, flush)(np.int64(8)) == 0 and t.cached_rows <= 8


# ---- batches -------------------------------------------------------------------------------

def _model(m, kind="dynamic", seed=0, **kw):
    cfg = configs.tiny(batch_size=16, **kw)
    return DLRM(cfg, manager=m, table_kind=kind, backend="numpy", cache=0.2, page_rows=4,
                seed=seed)


@pytest.mark.parametrize("change, error", [
    (lambda b: replace(b, labels=np.full(16, 5.0)), "between 0 and 1"),
    (lambda b: replace(b, labels=np.r_[np.zeros(15), -1.0]), "between 0 and 1"),
    (lambda b: replace(b, dense=b.dense.astype(np.complex64)), "real numbers"),
    (lambda b: replace(b, dense=b.dense.astype(object)), "real numbers"),
    (lambda b: replace(b, dense=np.where(np.eye(16, 13) > 0, np.nan, b.dense)),
     "NaN or infinity"),
    (lambda b: replace(b, dense=np.where(np.eye(16, 13) > 0, np.inf, b.dense)),
     "NaN or infinity"),
    (lambda b: replace(b, dense=np.where(np.eye(16, 13) > 0, 1e39, b.dense.astype(np.float64))), "too large"),
])
def test_train_step_refuses_labels_and_dense_inputs_out_of_range_before_changing_anything(
        m, change, error):
    model = _model(m)
    b = synthetic_dataset(model.config, num_batches=1).batch(0)
    before = model.state_dict()
    with pytest.raises((ValueError, TypeError), match=error):
        model.train_step(change(b))
    assert _same(model.state_dict(), before)
    assert np.isfinite(model.train_step(replace(b, labels=np.full(16, 0.5))))


# ---- state dicts ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_copies_a_model_which_then_trains_identically(m, kind):
    a, b = _model(m, kind, seed=1), _model(m, kind, seed=2)
    data = list(synthetic_dataset(a.config, "zipf", num_batches=4))
    a.train(data[:2])
    b.train(data[:1])
    b.load_state_dict(a.state_dict())
    assert _same(a.state_dict(), b.state_dict())
    for t in b.tables:
        if isinstance(t, CachedEmbeddingTable):
            t.check(clean=True)
    assert b.train(data[2:]) == a.train(data[2:])
    assert _same(a.state_dict(), b.state_dict())
    if kind == "static":    # a frozen cache keeps its rows
        assert all(t.cached_rows > 0 for t in b.tables)


def _drop(key):
    return lambda s: s.pop(key)


@pytest.mark.parametrize("change, error", [
    (_drop("emb.0"), "missing \\['emb.0'\\]"),
    (_drop("top.1.bias"), "missing \\['top.1.bias'\\]"),
    (lambda s: s.update(extra=np.zeros(3)), "unexpected \\['extra'\\]"),
    (lambda s: s.update({"emb.3": s["emb.3"][:-1]}), "shape"),
    (lambda s: s.update({"bottom.0.weight": s["bottom.0.weight"].T}), "shape"),
    (lambda s: s.update({"top.0.bias": s["top.0.bias"].astype(np.int64)}), "float array"),
    (lambda s: s.update({"emb.1": s["emb.1"].astype(np.int32)}), "float array"),
    (lambda s: s.update({"emb.1": s["emb.1"].astype(str)}), "float array"),
    (lambda s: s["emb.2"].__setitem__((0, 0), np.nan), "NaN or infinity"),
    (lambda s: s["bottom.1.weight"].__setitem__((0, 0), -np.inf), "NaN or infinity"),
    (lambda s: s.update({"emb.1": s["emb.1"].astype(np.float64) * 1e300}), "too large"),
])
@pytest.mark.parametrize("kind", ["simple", "dynamic"])
def test_load_state_dict_refuses_a_bad_entry_and_changes_nothing(m, kind, change, error):
    model, other = _model(m, kind, seed=1), _model(m, kind, seed=2)
    state = {k: v.copy() for k, v in other.state_dict().items()}
    change(state)            # every other entry is good: none of them may be loaded either
    before = model.state_dict()
    with pytest.raises((KeyError, ValueError, TypeError), match=error):
        model.load_state_dict(state)
    assert _same(model.state_dict(), before)
    with pytest.raises(TypeError, match="takes a dict"):
        model.load_state_dict(list(state.items()))


# ---- table kinds train bit for bit alike --------------------------------------------------

@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(fs=st.integers(1, 9), sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       batch=st.integers(1, 24), bag=st.integers(1, 3), interaction=st.sampled_from(["dot", "cat"]),
       distribution=st.sampled_from(["uniform", "zipf"]),
       cache=st.sampled_from([0.0, 0.3, 1.0]), page_rows=st.integers(1, 5),
       flush_policy=st.sampled_from(["oldest", "second-chance"]), seed=st.integers(0, 2**16))
def test_table_kinds_train_bit_for_bit_alike(m, fs, sizes, batch, bag, interaction,
                                             distribution, cache, page_rows, flush_policy, seed):
    cfg = configs.DLRMConfig("h", tuple(sizes), fs, (5, fs), (6, 1), batch, dense_features=3,
                             bag_size=bag, interaction=interaction, lr=0.4)
    data = list(synthetic_dataset(cfg, distribution, seed=seed, num_batches=3))
    runs = {}
    for kind in KINDS:
        model = DLRM(cfg, manager=m, table_kind=kind, backend="numpy", cache=cache, slack=0.1,
                     page_rows=page_rows, flush_policy=flush_policy, seed=seed)
        runs[kind] = (model.train(data), model.state_dict(), model.predict(data[0]))
        for t in model.tables:
            if isinstance(t, CachedEmbeddingTable):
                t.check()
    losses, state, prob = runs["fast"]
    assert all(math.isfinite(x) for x in losses)
    for kind, (l2, s2, p2) in runs.items():
        assert l2 == losses, kind
        assert _same(s2, state), kind
        assert np.array_equal(p2, prob), kind


# ---- table and model construction ----------------------------------------------------------

@pytest.mark.parametrize("rows, features, error", [
    (10.7, 4, TypeError), (10, 4.9, TypeError), (True, 4, TypeError), ("10", 4, TypeError),
    (None, 4, TypeError), (float("nan"), 4, TypeError), (0, 4, ValueError),
    (-3, 4, ValueError), (10, 0, ValueError),
])
@pytest.mark.parametrize("kind", KINDS)
def test_a_table_of_a_fractional_or_non_numeric_size_is_refused_not_truncated(
        m, kind, rows, features, error):
    from cachedarrays.models.dlrm import make_table
    with pytest.raises(error, match="integers|at least one row"):
        make_table(kind, rows, features, manager=m)
    assert make_table(kind, 10.0, np.int64(4), manager=m).shape == (10, 4)


@pytest.mark.parametrize("page_rows, error", [(2.5, TypeError), ("4", TypeError),
                                              (True, TypeError), (0, ValueError)])
def test_page_rows_must_be_a_positive_integer(m, page_rows, error):
    with pytest.raises(error, match="page_rows"):
        CachedEmbeddingTable(100, 4, manager=m, page_rows=page_rows)


@pytest.mark.parametrize("seed", [-1, 1.5, "a", None, True])
def test_a_model_seed_must_be_a_non_negative_integer(m, seed):
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        DLRM(configs.tiny(), manager=m, backend="numpy", seed=seed)


@pytest.mark.parametrize("resize", ["set_cachelower", "set_cacheslack"])
def test_resizing_a_frozen_table_unfreezes_its_empty_pool_so_it_can_be_filled_again(resize):
    with ca.Manager(fast="8MiB", slow="32MiB") as m:
        t = CachedEmbeddingTable(1000, 8, manager=m, cachelower=0.2, cacheslack=0.05,
                                     caching="static", seed=1)
        t.prepopulate(rows=np.arange(100))
        assert t.frozen and t.cached_rows == 100
        getattr(t, resize)(0.3)
        assert t.cached_rows == 0 and not t.frozen
        t.prepopulate(rows=np.arange(200))
        assert t.frozen and t.cached_rows == 200
        out = t.lookup(np.arange(10), np.arange(10))
        assert np.array_equal(np.asarray(out), np.asarray(t.base)[:10])
        assert t.stats()["hits"] == 10


# ---- a model's cache size in bytes ---------------------------------------------------------

@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 400), min_size=1, max_size=5), fs=st.integers(1, 6),
       part=st.floats(0.0, 1.0), kind=st.sampled_from(["static", "dynamic"]),
       spelling=st.sampled_from([int, lambda n: f"{n}B"]))
def test_a_byte_cache_size_is_the_whole_models_spread_over_its_tables(m, sizes, fs, part, kind,
                                                                      spelling):
    cfg = configs.DLRMConfig("h", tuple(sizes), fs, (5, fs), (6, 1), 8, dense_features=3)
    rowbytes = 4 * fs
    whole = [n * rowbytes for n in sizes]
    total = int(part * sum(whole))
    model = DLRM(cfg, manager=m, table_kind=kind, backend="numpy", cache=spelling(total),
                 slack=spelling(total // 2))
    lower = [t.cachelower for t in model.tables]
    assert sum(lower) <= total                               # never more than asked
    assert all(0 <= c <= w and c % rowbytes == 0 for c, w in zip(lower, whole))
    share = total / len(sizes)
    for c, w in zip(lower, whole):
        if w <= share:
            assert c == w                                    # smaller than its share: whole
    if any(c < w for c, w in zip(lower, whole)):             # no budget left over unused
        assert total - sum(lower) < len(sizes) * rowbytes
        uncached = [c for c, w in zip(lower, whole) if c < w]
        assert max(uncached) - min(uncached) <= 2 * rowbytes  # the others share evenly
    if kind == "dynamic":
        assert sum(t.cacheslack for t in model.tables) <= total // 2
    for t in model.tables:
        t.check()


def test_a_fraction_stays_each_tables_and_too_many_bytes_are_refused(m):
    cfg = configs.tiny()
    model = DLRM(cfg, manager=m, table_kind="dynamic", backend="numpy", cache=0.25)
    assert [t.cachelower for t in model.tables] == \
        [math.ceil(0.25 * n) * 4 * cfg.featuresize for n in cfg.table_sizes]
    whole = cfg.table_bytes
    small = min(cfg.table_sizes) * 4 * cfg.featuresize
    model = DLRM(cfg, manager=m, table_kind="dynamic", backend="numpy", cache=4 * small)
    assert model.tables[cfg.table_sizes.index(min(cfg.table_sizes))].cachelower == small
    for size in (whole + 1, f"{whole + 1}B"):
        with pytest.raises(ValueError, match=f"cache of {whole + 1:,} bytes is more than all its "
                                             f"tables .* the largest is {whole:,}"):
            DLRM(cfg, manager=m, table_kind="dynamic", backend="numpy", cache=size)
    with pytest.raises(ValueError, match="slack must be a fraction .* or a size in bytes"):
        DLRM(cfg, manager=m, table_kind="dynamic", backend="numpy", slack="lots")
