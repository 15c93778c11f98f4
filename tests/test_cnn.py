"""CNN layers and models on CachedArrays: gradients, training, placement-independent numerics,
traces (named kernels, layer and step marks, stable ids), policy figures from the cost model,
real runs against replays of their traces, 2LM, error messages and the benchmark script (all at
tiny shapes)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import cachedarrays as ca
from helpers import traced_training
from cachedarrays.models import cnn
from cachedarrays.models.backend import available_backends
from cachedarrays.replay import evaluate
from cachedarrays.trace import TraceError

BACKENDS = available_backends()
ONEDNN = pytest.mark.skipif("onednn" not in BACKENDS, reason="libdnnl not loadable")
TINY = dict(batch=2, image=16, classes=5, width=16)


def _session(fast="64MiB", slow="256MiB", policy="lru", backend="numpy", dtype=np.float64, **opts):
    m = ca.Manager(fast=fast, slow=slow, policy=policy, policy_options=opts or None)
    return m, cnn.Session(m, backend, dtype=dtype)


def _read(a):
    with ca.readable(a) as v:
        return np.array(v)


# ---- layer gradients through the CachedArray path vs finite differences ----------------------

def _layers(shape):
    n, c, h, w = shape
    return [
        cnn.Conv2d("conv", shape, 3, 3, stride=2, pad=1, bias=True),
        cnn.BatchNorm2d("bn", shape),
        cnn.ReLU("relu", shape),
        cnn.MaxPool2d("maxpool", shape, 2, 2),
        cnn.AvgPool2d("avgpool", shape, 3, 2, 1),
        cnn.Chain("dense", [cnn.Flatten("flat", shape), cnn.Dense("fc", (n, c * h * w), 4)]),
        cnn.ResidualBlock("block", shape, 2, 2, bottleneck=True),
        cnn.DenseLayer("denselayer", shape, growth=2, bn_size=2),
    ]


@pytest.mark.parametrize("index", range(8), ids=lambda i: ["conv", "bn", "relu", "maxpool",
                                                             "avgpool", "dense", "resblock",
                                                             "denselayer"][i])
def test_layer_gradients_match_finite_differences(index):
    shape = (2, 3, 5, 5)
    layer = _layers(shape)[index]
    m, s = _session(fast="1MiB", slow="64MiB")     # small fast memory: arrays do move
    with m:
        rng = np.random.default_rng(index)
        layer.init(s, rng)
        x0 = rng.standard_normal(shape)
        r = rng.standard_normal(layer.out_shape)

        def loss(xv):
            x = ca.asarray(xv.copy(), manager=m)
            y, pb = s.rrule(layer, x)
            return float(np.sum(_read(y) * r)), x, pb

        _, x, pb = loss(x0)
        dx = _read(pb(ca.asarray(r, manager=m)))
        grads = {p.name: _read(p.grad) for p in layer.params()}
        eps = 1e-6
        for _ in range(6):
            idx = tuple(rng.integers(0, d) for d in shape)
            xp, xm = x0.copy(), x0.copy()
            xp[idx] += eps
            xm[idx] -= eps
            fd = (loss(xp)[0] - loss(xm)[0]) / (2 * eps)
            assert dx[idx] == pytest.approx(fd, rel=1e-4, abs=1e-6), layer.name
        for p in layer.params():
            with ca.writable(p.value) as v:
                flat = v.reshape(-1)
                j = int(rng.integers(0, flat.size))
                old = flat[j]
                flat[j] = old + eps
                up = loss(x0)[0]
                with ca.writable(p.value) as v2:
                    v2.reshape(-1)[j] = old - eps
                down = loss(x0)[0]
                with ca.writable(p.value) as v2:
                    v2.reshape(-1)[j] = old
            assert grads[p.name].reshape(-1)[j] == pytest.approx((up - down) / (2 * eps),
                                                                 rel=1e-4, abs=1e-6), p.name


@ONEDNN
def test_onednn_layers_match_numpy_through_cachedarrays():
    shape = (2, 16, 6, 6)
    outs = {}
    for be in ("numpy", "onednn"):
        block = cnn.ResidualBlock("block", shape, 8, 1, bottleneck=True)
        m, s = _session(fast="256KiB", backend=be, dtype=np.float32)
        with m:
            block.init(s, np.random.default_rng(0))
            rng = np.random.default_rng(1)
            x = ca.asarray(rng.standard_normal(shape, dtype=np.float32), manager=m)
            y, pb = s.rrule(block, x)
            yv = _read(y)
            dy = rng.standard_normal(block.out_shape, dtype=np.float32)
            dx = _read(pb(ca.asarray(dy, manager=m)))
            outs[be] = (yv, dx, [_read(p.grad) for p in block.params()])
    for a, b in zip(outs["numpy"][:2], outs["onednn"][:2]):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
    for a, b in zip(outs["numpy"][2], outs["onednn"][2]):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)


# ---- models build and train ----------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", pytest.param("onednn", marks=ONEDNN)])
@pytest.mark.parametrize("name,depth", [("vgg", 11), ("resnet", 18), ("resnet", 50),
                                        ("densenet", 121)])
def test_every_model_trains_one_step(name, depth, backend):
    shape = dict(TINY, image=8) if name == "densenet" else TINY
    model = cnn.build(name, depth, **shape)
    m, s = _session(fast="32MiB", backend=backend, dtype=np.float32)
    with m:
        model.init(s, seed=0)
        before = model.weights()
        x, y = cnn.synthetic_batch(model)
        loss = cnn.train_step(s, model, x, y, cnn.SGD(0.01))
        assert np.isfinite(loss) and loss > 0
        after = model.weights()
        assert any(not np.array_equal(before[k], after[k]) for k in before)
        live = {o.id for o in m.objects()}
        assert live == ca.preserve([p.value for p in model.params()])   # only weights remain
        m.check()


def test_deep_variants_build_with_the_documented_depths():
    assert cnn.build("vgg", 116, **TINY).param_count() > cnn.build("vgg", 16, **TINY).param_count()
    convs = [u for u in cnn.build("vgg", 416, **TINY).units if isinstance(u, cnn.Conv2d)]
    assert len(convs) == 413
    for depth in (200,):
        assert len(cnn.build("resnet", depth, **TINY).units) > 60
    assert cnn.build("densenet", 264, **dict(TINY, image=8)).param_count() > 0


def _train(name, depth, setup=None, policy=None, budget="64MiB", steps=2, backend="numpy",
           **shape):
    model = cnn.build(name, depth, **(shape or TINY))
    if setup is not None:
        m, s = cnn.make_session(setup, slow="256MiB", backend=backend,
                                **cnn.dram_budget(setup, budget))
    else:
        m = ca.Manager(fast=budget, slow="256MiB", policy=policy)
        s = cnn.Session(m, backend)
    with m:
        model.init(s, seed=3)
        for i in range(steps):
            x, y = cnn.synthetic_batch(model, seed=i)
            cnn.train_step(s, model, x, y, cnn.SGD(0.05))
        moved = m.stats()["moved"]
        return model.weights(), moved


CONFIGS = [("fast-only", None, "64MiB"), ("none", None, "48KiB"), ("L", None, "48KiB"),
           ("LM", None, "48KiB"), ("LMP", None, "48KiB"), ("LM", None, 0), ("LMP", None, "8KiB"),
           (None, "firsttouch", "48KiB"), (None, "slowonly", "64MiB"), ("2lm", None, "16KiB"),
           ("2lm-none", None, "16KiB")]


@pytest.mark.parametrize("name,depth,shape", [("vgg", 11, TINY), ("resnet", 18, TINY),
                                              ("densenet", 121, dict(TINY, image=8))])
def test_weights_are_bitwise_equal_under_every_policy_and_budget(name, depth, shape):
    ref, _ = _train(name, depth, setup="fast-only", **shape)
    evicted = 0
    for setup, policy, budget in CONFIGS[1:]:
        w, moved = _train(name, depth, setup=setup, policy=policy, budget=budget, **shape)
        evicted += moved.get("fast->slow", {}).get("bytes", 0)
        for k in ref:
            assert np.array_equal(ref[k], w[k]), (setup or policy, budget, k)
    assert evicted > 0          # the small budgets really moved data


@ONEDNN
def test_onednn_weights_are_bitwise_equal_across_budgets():
    ref, _ = _train("resnet", 18, setup="fast-only", backend="onednn")
    for setup, budget in (("LM", "32KiB"), ("LMP", "32KiB"), ("2lm", "16KiB")):
        w, _ = _train("resnet", 18, setup=setup, budget=budget, backend="onednn")
        for k in ref:
            assert np.array_equal(ref[k], w[k]), (setup, k)


def _train_fused(name, depth, fused, setup="LM", budget="48KiB", steps=2, backend="numpy",
                 **shape):
    model = cnn.build(name, depth, **(shape or TINY))
    m, s = cnn.make_session(setup, slow="256MiB", backend=backend, **cnn.dram_budget(setup, budget))
    with m:
        model.init(s, seed=3)
        m.reset_stats()
        losses = []
        for i in range(steps):
            x, y = cnn.synthetic_batch(model, seed=i)
            losses.append(cnn.train_step(s, model, x, y, cnn.SGD(0.05), fused=fused))
        return model.weights(), losses, m.stats()


@pytest.mark.parametrize("name,depth,shape", [("vgg", 11, TINY), ("resnet", 50, TINY),
                                              ("densenet", 121, dict(TINY, image=8))])
@pytest.mark.parametrize("setup,budget", [("fast-only", "64MiB"), ("LM", "48KiB"), ("2lm", "16KiB")])
def test_fused_sgd_gives_bitwise_the_weights_of_the_unfused_step(name, depth, shape, setup, budget):
    w0, l0, _ = _train_fused(name, depth, False, setup, budget, **shape)
    w1, l1, _ = _train_fused(name, depth, True, setup, budget, **shape)
    assert l0 == l1
    for k in w0:
        assert np.array_equal(w0[k], w1[k]), (setup, k)


@ONEDNN
def test_onednn_fused_sgd_is_bitwise_the_unfused_step():
    w0, _, _ = _train_fused("resnet", 18, False, "LM", "32KiB", backend="onednn")
    w1, _, _ = _train_fused("resnet", 18, True, "LM", "32KiB", backend="onednn")
    for k in w0:
        assert np.array_equal(w0[k], w1[k]), k


def test_a_session_without_stable_ids_trains_to_the_same_weights():
    """stable_ids=False (an untraced run: no allocation-site lookup per new array) attaches no
    StableIds observer and changes nothing else."""
    from cachedarrays.trace import StableIds
    weights = []
    for stable in (True, False):
        model = cnn.build("resnet", 18, **TINY)
        m, s = cnn.make_session("fast-only", "64MiB", "1MiB", "numpy", stable_ids=stable)
        with m:
            assert any(isinstance(o, StableIds) for o in m._observers) is stable
            model.init(s)
            x, y = cnn.synthetic_batch(model)
            for _ in range(2):
                cnn.train_step(s, model, x, y, cnn.SGD(0.01))
            weights.append([np.array(p.value) for p in model.params()])
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def test_fused_sgd_frees_each_gradient_inside_its_pullback():
    model = cnn.build("resnet", 18, **TINY)
    m, s = cnn.make_session("fast-only", "64MiB", "1MiB", "numpy")
    with m:
        model.init(s)
        params = model.params()
        weights = ca.preserve([p.value for p in params])
        seen = []
        orig = cnn.SGD.update

        def update(self, s_, p):
            live_grads = [q.name for q in params if q.grad is not None and q is not p]
            seen.append(live_grads)
            orig(self, s_, p)
            assert p.grad is None               # freed at once
        cnn.SGD.update = update
        try:
            x, y = cnn.synthetic_batch(model)
            cnn.train_step(s, model, x, y, cnn.SGD(0.01))
        finally:
            cnn.SGD.update = orig
        assert len(seen) == len(params)
        assert max(len(g) for g in seen) <= 1   # at most the layer's other gradient (its bias)
        assert {o.id for o in m.objects()} == weights
    fused, unfused = (_train_fused("resnet", 18, f, "fast-only", "64MiB", steps=1)[2]
                      for f in (True, False))
    assert fused["devices"]["fast"]["peak_bytes"] < unfused["devices"]["fast"]["peak_bytes"]


def test_a_pullback_frees_the_output_and_state_its_layer_saved():
    shape = (2, 3, 6, 6)
    for setup, frees in (("LM", True), ("L", False)):
        m, s = cnn.make_session(setup, "8MiB", "8MiB", "numpy")
        with m:
            conv = cnn.Conv2d("conv", shape, 4, 3, pad=1)
            chain = cnn.Chain("c", [conv, cnn.BatchNorm2d("bn", conv.out_shape),
                                    cnn.ReLU("relu", conv.out_shape),
                                    cnn.MaxPool2d("pool", conv.out_shape, 2)])
            chain.init(s, np.random.default_rng(0))
            x = ca.asarray(np.ones(shape, np.float32), manager=m)
            y, pb = chain.forward(s, x)
            dy = ca.ones(y.shape, dtype=np.float32, manager=m)
            dx = pb(dy)
            needed = ca.preserve(x, dy, dx, [(p.value, p.grad) for p in chain.params()])
            left = {o.id for o in m.objects()}
            if frees:    # outputs, BN mean/var, pooling state and inner gradients are gone
                assert left == needed
            else:        # without the cleanup switch they wait for the end of the iteration
                assert left > needed and y.object.id in left


def test_loss_falls_on_a_learnable_task():
    model = cnn.build("resnet", 18, batch=16, image=8, classes=2, width=16)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 16)
    x = rng.standard_normal(model.input_shape).astype(np.float32) * 0.5
    x[:, 0] += np.where(y == 1, 1.0, -1.0)[:, None, None]
    m, s = cnn.make_session("LM", "256KiB", "64MiB", "numpy")
    with m:
        model.init(s, seed=0)
        opt = cnn.SGD(0.05)
        losses = [cnn.train_step(s, model, x, y, opt) for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_cleanup_lowers_peak_memory_and_annotations_switch_off():
    peaks = {}
    for setup in ("L", "LM", "fast-only"):
        model = cnn.build("vgg", 11, **TINY)
        m, s = cnn.make_session(setup, "64MiB", "64MiB", "numpy")
        with m:
            model.init(s)
            x, y = cnn.synthetic_batch(model)
            m.reset_stats()
            cnn.train_step(s, model, x, y, cnn.SGD(0.01))
            peaks[setup] = m.stats()["devices"]["fast"]["peak_bytes"]
    assert peaks["LM"] < peaks["L"]
    assert peaks["fast-only"] == peaks["LM"]


# ---- setups and their sizes -------------------------------------------------------------------

def test_setups_use_the_lru_presets_of_table_4_7():
    from cachedarrays.policies import LRU
    for setup, switches in (("none", (False, False, False)), ("L", (True, False, False)),
                            ("LM", (True, True, False)), ("LMP", (True, True, True))):
        p = cnn.make_policy(setup)
        assert isinstance(p, LRU)
        assert (p.local_alloc, p.allows_cleanup, p.allows_prefetch) == switches
    assert cnn.SETUPS == ("none", "L", "LM", "LMP", "fast-only", "2lm", "2lm-none",
                          "sentinel", "deeptm", "autotm")
    assert cnn.PLANNED == cnn.SETUPS[-3:]


def test_a_budget_is_bytes_a_size_or_a_percentage_of_the_footprint():
    assert cnn.parse_budget("25%", 4 << 20) == 1 << 20
    assert cnn.parse_budget(" 12.5% ", 1000) == 125
    assert cnn.parse_budget("64MiB") == cnn.parse_budget("64MiB", 1) == 64 << 20
    assert cnn.parse_budget(4096) == 4096
    with pytest.raises(ValueError, match="no footprint was given"):
        cnn.parse_budget("25%")
    with pytest.raises(ValueError, match="'abc%' is not a percentage"):
        cnn.parse_budget("abc%", 1000)
    with pytest.raises(ValueError, match="'-5%' is not a percentage"):
        cnn.parse_budget("-5%", 1000)


def test_the_2lm_dram_cache_is_its_own_size_and_fast_is_the_managers_fast_memory():
    m, s = cnn.make_session("2lm", "1MiB", "8MiB", dram_cache="64KiB")
    with m:
        assert m.policy.cache.capacity == 64 << 10
        assert m.stats()["devices"]["fast"]["heap_capacity"] == 1 << 20
    m, s = cnn.make_session("LM", "1MiB", "8MiB")
    with m:
        assert getattr(m.policy, "cache", None) is None
        assert m.stats()["devices"]["fast"]["heap_capacity"] == 1 << 20
    with pytest.raises(ValueError, match="give its size as dram_cache="):
        cnn.make_session("2lm", 0, "8MiB")
    with pytest.raises(ValueError, match="setup 'LM' simulates no DRAM cache"):
        cnn.make_session("LM", "1MiB", "8MiB", dram_cache="64KiB")
    with pytest.raises(ValueError, match="give its size as dram_cache="):
        cnn.make_policy("2lm-none")
    assert cnn.dram_budget("2lm-none", "25%") == {"fast": 0, "dram_cache": "25%"}
    assert cnn.dram_budget("LMP", "25%") == {"fast": "25%"}


def test_a_trainer_gives_each_setup_the_dram_it_was_asked_for():
    footprint = 4 << 20
    tr = cnn.Trainer("vgg", 11, setup="2lm", dram_cache="25%", footprint=footprint, **TINY)
    try:
        assert tr.budget == tr.m.policy.cache.capacity == 1 << 20
        assert tr.m.stats()["devices"]["fast"]["heap_capacity"] == 0
    finally:
        tr.close()
    tr = cnn.Trainer("vgg", 11, setup="LM", fast="64KiB", footprint=footprint, **TINY)
    try:
        assert tr.budget == tr.m.stats()["devices"]["fast"]["heap_capacity"] == 64 << 10
        assert getattr(tr.m.policy, "cache", None) is None
    finally:
        tr.close()
    with pytest.raises(ValueError, match="setup 'LM' simulates no DRAM cache"):
        cnn.Trainer("vgg", 11, setup="LM", dram_cache="25%", footprint=footprint, **TINY)
    with pytest.raises(TypeError):                 # a setup is given as setup=
        cnn.Trainer("vgg", 11, mode="LM", footprint=footprint, **TINY)


# ---- traces, the cost model, replays and 2LM ---------------------------------------------------

KERNELS = {"conv2d_forward", "conv2d_backward_data", "conv2d_backward_weights",
           "batchnorm_forward", "batchnorm_backward", "relu_forward", "relu_backward",
           "maxpool_forward", "maxpool_backward", "avgpool_forward", "avgpool_backward",
           "dense_forward", "dense_backward_data", "dense_backward_weights", "add",
           "softmax_cross_entropy", "sgd_update", "concat_channels", "split_channels",
           "batchnorm_relu_forward", "batchnorm_relu_backward", "slice_channels",
           "place_channels"}


@pytest.fixture(scope="module")
def reference():
    """Fast-only kernel times of resnet18 at TINY (one measurement for the module's tests)."""
    return cnn.fast_only_reference("resnet", 18, **TINY)


def _traced(setup="LM", budget="96KiB", steps=3, name="resnet", depth=18, shape=TINY):
    """(model, trace of init + steps training iterations, fast memory size) of one setup."""
    model, t, m, _ = traced_training(setup, budget, steps, name, depth, shape)
    return model, t, m.fast.size


def test_a_traced_iteration_has_named_kernels_layer_and_step_marks_and_stable_ids():
    model, t, _ = _traced(steps=3)
    t.validate()
    assert t.steps == 3                                  # a trace of N iterations has N steps
    groups = t.step_kernels()
    assert len(groups) == 3 and all(groups)
    names = [[t.kernels[k][0] for k in g] for g in groups]
    assert names[0] == names[1] == names[2]              # the same kernels every iteration
    # Each kernel is named by Session.kernel, except the acquires of Flatten's reshape views
    # (forward and pullback): CachedArray view operations acquire their array, and a trace
    # records every acquire as a kernel ("view": it touches no data and costs nothing).
    assert set(names[0]) - {"view"} <= KERNELS
    assert names[0].count("view") == 2 * sum(isinstance(u, cnn.Flatten) for u in model.units)
    assert {"conv2d_forward", "conv2d_backward_weights", "batchnorm_forward", "add",
            "softmax_cross_entropy", "sgd_update"} <= set(names[0])
    # One layer mark after each top-level unit's forward and one after its pullback.
    per_step, layers = [], 0
    for e in t.events:
        if e[0] == "layer":
            layers += 1
        elif e[0] == "step":
            per_step.append(layers)
            layers = 0
    assert per_step == [2 * len(model.units)] * 3 and layers == 0
    # Stable ids: iterations 2 and 3 use the same objects, kernel by kernel.
    ops = [[t.kernels[k][1:] for k in g] for g in groups]
    assert ops[1] == ops[2]
    assert all(sid.startswith("init:") for sid in ops[0][0][1])   # the first conv's weights
    weights = {sid for r, w in ops[2] for sid in (*r, *w) if sid.startswith("init:")}
    assert len(weights) == len(model.params())           # made by model.init, before any step


def test_without_annotations_the_trace_has_the_same_kernels_and_marks():
    model = cnn.build("vgg", 11, **TINY)
    traces = []
    for annotations in (True, False):
        m = ca.Manager(fast="32MiB", slow="64MiB")
        s = cnn.Session(m, annotations=annotations)
        with m:
            model.init(s, seed=0)
            with ca.trace(m) as t:
                x, y = cnn.synthetic_batch(model)
                cnn.train_step(s, model, x, y, cnn.SGD(0.01))
            traces.append(t)
    a, b = traces
    assert [k[0] for k in a.kernels] == [k[0] for k in b.kernels]
    assert [e for e in a.events if e[0] in ("layer", "step")] == \
        [e for e in b.events if e[0] in ("layer", "step")]


def test_modelled_time_is_the_cost_model_of_the_trace_with_the_reference_times(reference,
                                                                                  tmp_path):
    assert reference.meta["footprint"] > 0 and reference.steps == cnn.REFERENCE_ITERATIONS
    recs = cnn.run("resnet", 18, setup="LM", fast="10%", iterations=2, reference=reference,
                   **TINY)
    r = recs[-1]
    tr = r["trace"]
    assert tr.steps == 1 and r["footprint"] == reference.meta["footprint"]
    # Bit for bit: the same trace and reference give the same figures on every evaluation...
    assert cnn.evaluate(tr, reference).last.time == r["modelled"] == r["step"].time
    assert cnn.evaluate(tr, reference).last == r["step"]
    # ... also after a round trip through a file ...
    again = ca.Trace.load(tr.save(tmp_path / "lm.trace.gz"))
    assert cnn.evaluate(again, reference).last == r["step"]
    # ... and they are the cost model of the decision log with the reference's kernel times
    # (the run's own measured times play no part).
    names, times = cnn.step_times(reference)
    assert [k[0] for k in tr.kernels] == names
    by_hand = ca.costmodel.evaluate(times, tr.decisions, tr.devices)
    assert by_hand.last.time == r["modelled"]
    assert r["run"].fast_only == pytest.approx(sum(times), rel=1e-12)
    assert r["modelled"] > r["run"].fast_only            # 10%: a penalty for slow operands
    f = r["figures"]
    assert f["k_slow_r"] == r["step"].kernel_read["slow"] > 0
    assert f["slow_w"] == f["f->s"] + f["k_slow_w"] and f["moved"] == r["step"].bytes_moved
    assert f["peak_fast"] <= r["budget"]
    with pytest.raises(TraceError, match="differs from the reference"):
        cnn.with_reference_times(tr, cnn.fast_only_reference("vgg", 11, iterations=1, **TINY))


def test_2lm_cache_traffic_feeds_the_cost_model(reference):
    recs = {setup: cnn.run("resnet", 18, setup=setup, iterations=2, reference=reference,
                           **cnn.dram_budget(setup, "10%"), **TINY)
            for setup in ("2lm", "2lm-none", "LM", "fast-only")}
    last = {k: v[-1] for k, v in recs.items()}
    mm = last["2lm"]["memory_mode"]
    assert mm["read_bytes"] > 0 and mm["write_bytes"] > 0
    assert mm["slow_read_bytes"] > 0 and mm["slow_write_bytes"] > 0
    assert mm["access_amplification"] >= 1
    assert mm["hits"] + mm["clean_misses"] + mm["dirty_misses"] == mm["read_lines"] + mm["write_lines"]
    step = last["2lm"]["step"]                           # the cache's traffic, kernel by kernel
    assert (step.kernel_read["slow"], step.kernel_write["slow"]) == \
        (mm["slow_read_bytes"], mm["slow_write_bytes"])
    assert (step.kernel_read["fast"], step.kernel_write["fast"]) == \
        (mm["dram_read_bytes"], mm["dram_write_bytes"])
    assert step.bytes_moved == 0 and step.stall == 0
    assert last["LM"]["memory_mode"] is None and last["LM"]["figures"]["k_slow_r"] > 0
    fo = last["fast-only"]
    assert fo["figures"]["slow_r"] == fo["figures"]["slow_w"] == fo["figures"]["moved"] == 0
    assert fo["modelled"] == pytest.approx(fo["run"].fast_only, rel=1e-12)   # no penalty
    for r in (last["LM"], last["2lm"], last["2lm-none"]):
        assert r["modelled"] > r["run"].fast_only
    # Cleanup frees temporaries early: fewer slow bytes through the cache.
    assert last["2lm"]["figures"]["slow_w"] < last["2lm-none"]["figures"]["slow_w"]


@pytest.mark.parametrize("setup,budget", [("LM", "48KiB"), ("LMP", "48KiB"), ("none", "96KiB"),
                                          ("2lm", "16KiB")])
def test_a_real_run_makes_the_decisions_of_the_replay_of_its_trace(reference, setup, budget):
    _, t, fast = _traced(setup, budget, steps=3)
    timed = cnn.with_reference_times(t, reference)
    real = evaluate(timed)
    policy = cnn.make_policy(setup, **({"dram_cache": budget} if setup == "2lm" else {}))
    rp = ca.replay(timed, policy=policy, fast=fast, slow="64MiB")
    assert rp.decisions == t.decisions
    assert [s.moved for s in rp.result.steps] == [s.moved for s in real.result.steps]
    assert len(real.result.steps) == 3
    for a, b in zip(real.result.steps, rp.result.steps):
        assert b.time == pytest.approx(a.time, rel=0.01)
        assert (b.kernel_read, b.kernel_write) == (a.kernel_read, a.kernel_write)
    if setup != "2lm":
        assert real.result.total.bytes_moved > 0        # the budget really moved data


def test_demo_returns_stats_of_a_run_under_a_quarter_budget():
    from cachedarrays.telemetry import format_stats
    stats = cnn.demo()
    assert "traffic between devices" in format_stats(stats)
    assert stats["budget"] == pytest.approx(0.25 * stats["footprint"], rel=0.01)


# ---- bad input ---------------------------------------------------------------------------------

def test_bad_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="valid models: vgg, resnet, densenet"):
        cnn.build("alexnet", 8)
    with pytest.raises(ValueError, match="valid depths: 18, 34, 50"):
        cnn.build("resnet", 51)
    with pytest.raises(ValueError, match="valid setups: none, L, LM, LMP, fast-only, 2lm"):
        cnn.check_setup("CA:X")


def test_shape_mismatches_name_the_layer():
    model = cnn.build("vgg", 11, **TINY)
    m, s = _session(dtype=np.float32)
    with m:
        model.init(s)
        bad = ca.zeros((2, 3, 8, 8), dtype=np.float32, manager=m)
        with pytest.raises(ValueError, match=r"model vgg11: input has shape \(2, 3, 8, 8\)"):
            model.forward(s, bad, [])
        with pytest.raises(ValueError, match=r"layer conv1_1: input has shape"):
            model.units[0].forward(s, bad)
    with pytest.raises(ValueError, match=r"layer pool: input 2x2 \(pad 0\) is smaller than its 3x3"):
        cnn.MaxPool2d("pool", (1, 4, 2, 2), 3, 2)
    with pytest.raises(ValueError, match=r"resnet18: image must be >= 1"):
        cnn.build("resnet", 18, batch=1, image=0)


def test_a_batch_that_cannot_fit_says_how_much_it_needs():
    with pytest.raises(MemoryError, match=r"needs about .* per training iteration"):
        cnn.run("vgg", 11, setup="LM", fast="16KiB", slow="64KiB", iterations=1, **TINY)


# ---- the benchmark script -------------------------------------------------------------------

def _bench():
    here = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
    sys.path.insert(0, os.path.abspath(here))
    try:
        import cnn as bench
    finally:
        sys.path.pop(0)
    return bench


def test_benchmark_runs_every_setup_end_to_end(tmp_path, capsys):
    bench = _bench()
    assert bench.main(["--model", "resnet", "--depth", "18", "--batch", "2", "--image", "16",
                       "--width", "16", "--backend", "numpy", "--fast", "25%", "--iterations", "2",
                       "--setup", ",".join(cnn.SETUPS), "--no-progress", "--plot", str(tmp_path),
                       "--sweep", "--outdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for setup in cnn.SETUPS:
        assert f"{setup:>9} " in out
    assert "Modelled time" in out and "target: LM slow-memory writes" in out
    assert "target: LM modelled time / fast-only modelled time" in out
    for f in ("resnet18_occupancy.png", "resnet18_traffic.png", "resnet18_sweep.png"):
        assert (tmp_path / f).stat().st_size > 1000
    saved = list((tmp_path / "times").iterdir())
    assert len(saved) == 1 and "measured now" in out


def _policy_lines(out):
    """The policy-figure lines of a benchmark report (the table and the target lines)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("policy figures"))
    end = next(i for i, line in enumerate(lines) if line.startswith("wall-clock figures"))
    return lines[start:end] + [line for line in lines if line.startswith(("target", "  floor"))]


def test_benchmark_prints_the_same_policy_figures_twice(tmp_path, capsys):
    bench = _bench()
    argv = ["--model", "vgg", "--depth", "11", "--batch", "2", "--image", "16", "--width", "16",
            "--backend", "numpy", "--fast", "20%", "--iterations", "2", "--setup",
            "2lm,LM,LMP,fast-only", "--no-progress", "--outdir", str(tmp_path)]
    outs = []
    for _ in range(2):
        assert bench.main(argv) == 0
        outs.append(capsys.readouterr().out)
    assert "measured now" in outs[0] and "loaded from" in outs[1]
    assert _policy_lines(outs[0]) == _policy_lines(outs[1])
    assert len(_policy_lines(outs[0])) >= 7
    other = tmp_path / "other.trace.gz"                 # times of another model are refused
    (tmp_path / "times").rename(tmp_path / "t")
    os.replace(next((tmp_path / "t").iterdir()), other)
    with pytest.raises(SystemExit, match="holds the kernel times of"):
        bench.main(argv[:3] + ["13"] + argv[4:] + ["--times", str(other)])


def test_torch_peer_runs_in_its_own_process_and_reports_step_times():
    pytest.importorskip("torch")
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "_torch_cnn.py")
    cfg = dict(model="resnet", depth=18, batch=2, image=16, classes=5, width=16, threads=1, warmup=1)
    p = subprocess.run([sys.executable, script, json.dumps(cfg)], input="2\nquit\n", text=True,
                       capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr
    ready, result = (json.loads(line) for line in p.stdout.splitlines())
    assert ready["params"] == ready["expected_params"] == cnn.build("resnet", 18, **TINY).param_count()
    assert ready["threads"] == 1
    assert len(result["times"]) == 2 and all(t > 0 for t in result["times"])
    assert np.isfinite(result["loss"])


@pytest.mark.parametrize("argv, says", [
    (["--setup", "LX"], "valid setups"),
    (["--model", "vgg", "--depth", "12"], "valid depths"),
    (["--model", "vgg", "--depth", "11", "--batch", "2", "--image", "16", "--width", "16",
      "--slow", "64KiB"], "needs about"),
])
def test_benchmark_bad_input_lists_valid_names(capsys, argv, says):
    bench = _bench()
    try:
        rc = bench.main(argv + ["--no-progress"])
    except SystemExit as e:                 # argparse's own refusals
        rc = e.code
    assert rc not in (0, None)              # 2 for a usage error, or the message itself
    assert says in f"{rc} {capsys.readouterr().err}"


def test_the_benchmark_passes_budgets_through_and_prints_what_the_trainer_uses(monkeypatch):
    from cachedarrays.models.cnn import runner
    bench = _bench()
    parsed = []
    real = runner.parse_budget
    monkeypatch.setattr(runner, "parse_budget",
                        lambda size, *a, **k: parsed.append(size) or real(size, *a, **k))
    args = bench.parse_args(["--model", "vgg", "--depth", "11", "--batch", "2", "--image", "16",
                             "--width", "16", "--backend", "numpy"])
    footprint = 4 << 20
    for spec, want in (("25%", 1 << 20), ("64MiB", 64 << 20), ("1000000", 10**6)):
        args.fast = spec
        for setup in ("LM", "2lm"):
            parsed.clear()
            tr = bench.make_trainer(args, setup, 256 << 20, footprint)
            tr.close()
            assert parsed[-1] == spec                 # handed over as given, parsed by the trainer
            assert tr.budget == want == bench._budget(spec, footprint)[0]
    args.fast, args.dram_cache = "25%", "64KiB"
    assert bench._dram(args, "2lm") == {"fast": 0, "dram_cache": "64KiB"}
    assert bench._dram(args, "LM") == {"fast": "25%"}


def test_a_session_skips_only_the_annotations_its_policy_declares_it_ignores():
    class PrefetchingFastOnly(ca.policies.FastOnly):     # overrides prefetch, declares nothing
        def prefetch(self, obj, force=False):
            return ca.policies.Policy.prefetch(self, obj, force)

    cases = [(ca.policies.LRU(), True, True),
             (ca.policies.LRU(prefetch=False), False, True),
             (ca.policies.Policy(), True, False),
             (ca.policies.FastOnly(), False, False),
             (ca.policies.SlowOnly(), False, False),
             (PrefetchingFastOnly(), True, False)]
    for policy, prefetches, softevicts in cases:
        with ca.Manager(fast="1MiB", slow="4MiB", policy=policy) as m:
            s = cnn.Session(m)
            assert (s._prefetches, s._softevicts) == (prefetches, softevicts), policy


def test_the_annotation_walkers_never_look_inside_a_session():
    m, s = _session()
    with m:
        x = ca.ones(3, manager=m)
        s.scratch = x                     # even an array hung on it is not the walkers' business
        assert ca.arrays_in(s, (s, [s])) == []
        assert [a.object for a in ca.arrays_in(s, x)] == [x.object]
