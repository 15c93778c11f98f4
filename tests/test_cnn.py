"""CNN layers and models on CachedArrays: gradients, training, placement-independent numerics,
the 2LM tracer, error messages and the benchmark script (all at tiny shapes)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.models import cnn
from cachedarrays.models.backend import available_backends

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


def _train(name, depth, mode=None, policy=None, fast="64MiB", steps=2, backend="numpy", **shape):
    model = cnn.build(name, depth, **(shape or TINY))
    if mode is not None:
        m, s = cnn.make_session(mode, fast, "256MiB", backend)
    else:
        m = ca.Manager(fast=fast, slow="256MiB", policy=policy)
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
    ref, _ = _train(name, depth, mode="fast-only", **shape)
    evicted = 0
    for mode, policy, fast in CONFIGS[1:]:
        w, moved = _train(name, depth, mode=mode, policy=policy, fast=fast, **shape)
        evicted += moved.get("fast->slow", {}).get("bytes", 0)
        for k in ref:
            assert np.array_equal(ref[k], w[k]), (mode or policy, fast, k)
    assert evicted > 0          # the small budgets really moved data


@ONEDNN
def test_onednn_weights_are_bitwise_equal_across_budgets():
    ref, _ = _train("resnet", 18, mode="fast-only", backend="onednn")
    for mode, fast in (("LM", "32KiB"), ("LMP", "32KiB"), ("2lm", "16KiB")):
        w, _ = _train("resnet", 18, mode=mode, fast=fast, backend="onednn")
        for k in ref:
            assert np.array_equal(ref[k], w[k]), (mode, k)


def _train_fused(name, depth, fused, mode="LM", fast="48KiB", steps=2, backend="numpy", **shape):
    model = cnn.build(name, depth, **(shape or TINY))
    m, s = cnn.make_session(mode, fast, "256MiB", backend)
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
@pytest.mark.parametrize("mode,fast", [("fast-only", "64MiB"), ("LM", "48KiB"), ("2lm", "16KiB")])
def test_fused_sgd_gives_bitwise_the_weights_of_the_unfused_step(name, depth, shape, mode, fast):
    w0, l0, _ = _train_fused(name, depth, False, mode, fast, **shape)
    w1, l1, _ = _train_fused(name, depth, True, mode, fast, **shape)
    assert l0 == l1
    for k in w0:
        assert np.array_equal(w0[k], w1[k]), (mode, k)


@ONEDNN
def test_onednn_fused_sgd_is_bitwise_the_unfused_step():
    w0, _, _ = _train_fused("resnet", 18, False, "LM", "32KiB", backend="onednn")
    w1, _, _ = _train_fused("resnet", 18, True, "LM", "32KiB", backend="onednn")
    for k in w0:
        assert np.array_equal(w0[k], w1[k]), k


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
    for mode, frees in (("LM", True), ("L", False)):
        m, s = cnn.make_session(mode, "8MiB", "8MiB", "numpy")
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
    for mode in ("L", "LM", "fast-only"):
        model = cnn.build("vgg", 11, **TINY)
        m, s = cnn.make_session(mode, "64MiB", "64MiB", "numpy")
        with m:
            model.init(s)
            x, y = cnn.synthetic_batch(model)
            m.reset_stats()
            cnn.train_step(s, model, x, y, cnn.SGD(0.01))
            peaks[mode] = m.stats()["devices"]["fast"]["peak_bytes"]
    assert peaks["LM"] < peaks["L"]
    assert peaks["fast-only"] == peaks["LM"]


# ---- tracing, 2LM and the modelled time -------------------------------------------------------

def test_memory_mode_tracer_counts_traffic():
    recs = {mode: cnn.run("resnet", 18, mode=mode, fast="10%", iterations=2, **TINY)
            for mode in ("2lm", "2lm-none", "LM", "fast-only")}
    mm = recs["2lm"][-1]["trace"]["memory_mode"]
    assert mm["read_bytes"] > 0 and mm["write_bytes"] > 0
    assert mm["slow_read_bytes"] > 0 and mm["slow_write_bytes"] > 0
    assert mm["access_amplification"] >= 1
    assert mm["hits"] + mm["clean_misses"] + mm["dirty_misses"] == mm["read_lines"] + mm["write_lines"]
    lm = recs["LM"][-1]
    assert lm["trace"]["slow_read_bytes"] > 0
    fo = recs["fast-only"][-1]
    assert fo["trace"]["slow_read_bytes"] == fo["trace"]["slow_write_bytes"] == 0
    assert fo["modelled"] == pytest.approx(fo["wall"] - fo["trace"]["overhead_seconds"])  # no penalty
    for r in (lm, recs["2lm"][-1]):                      # a positive penalty on T_wall'
        assert r["modelled"] > r["wall"] - r["trace"]["overhead_seconds"]
        assert r["modelled_sum"] >= r["modelled"]


def test_modelled_time_charges_each_slow_output_kernel_once():
    from types import SimpleNamespace
    from cachedarrays.policies.memorymode import get_profile
    p = get_profile("optane")
    gb = 1e9
    rpen = 1 / (p.slow_read_gbps * gb) - 1 / (p.dram_read_gbps * gb)
    wpen = 1 / (p.slow_write_gbps * gb) - 1 / (p.dram_write_gbps * gb)
    # two slow-output kernels: one bandwidth-bound (many bytes, short), one factor-bound
    tr = SimpleNamespace(cache=None, overhead_seconds=0.25, slow_read_bytes=3 * 10**9,
                         slow_write_bytes=2 * 10**9,
                         slow_output=[(10**9, 2 * 10**9, 0.001), (0, 0, 0.5)])
    stats = {"moved": {"slow->fast": {"bytes": 10**9}, "fast->slow": {"bytes": 10**9}}}
    base = 1.25 - 0.25 + 1e9 * rpen + 1e9 * wpen + 2e9 * rpen      # reads outside slow-output kernels
    k1 = 1e9 * rpen + 2e9 * wpen
    got = cnn.modelled_time(1.25, stats, tr, "optane", slow_output_factor=2.0)
    assert got == pytest.approx(base + max(k1, 0.001) + max(0, 0.5))
    summed = cnn.modelled_time(1.25, stats, tr, "optane", slow_output_factor=2.0, combine="sum")
    assert summed == pytest.approx(base + k1 + 0.001 + 0.5)
    assert "max(" in cnn.FORMULA and "T_wall'" in cnn.FORMULA


def test_demo_runs_quickly_and_returns_stats():
    from cachedarrays.telemetry import format_stats
    stats = cnn.demo()
    assert stats["seconds"] < 30
    assert "traffic between devices" in format_stats(stats)
    assert stats["budget"] == pytest.approx(0.25 * stats["footprint"], rel=0.01)


# ---- bad input ---------------------------------------------------------------------------------

def test_bad_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="valid models: vgg, resnet, densenet"):
        cnn.build("alexnet", 8)
    with pytest.raises(ValueError, match="valid depths: 18, 34, 50"):
        cnn.build("resnet", 51)
    with pytest.raises(ValueError, match="valid modes: none, L, LM, LMP, fast-only, 2lm"):
        cnn.check_mode("CA:X")


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
        cnn.run("vgg", 11, mode="LM", fast="16KiB", slow="64KiB", iterations=1, **TINY)


# ---- the benchmark script -------------------------------------------------------------------

def _bench():
    here = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
    sys.path.insert(0, os.path.abspath(here))
    try:
        import cnn as bench
    finally:
        sys.path.pop(0)
    return bench


def test_benchmark_runs_every_mode_end_to_end(tmp_path, capsys):
    bench = _bench()
    assert bench.main(["--model", "resnet", "--depth", "18", "--batch", "2", "--image", "16",
                       "--width", "16", "--backend", "numpy", "--fast", "25%", "--iterations", "2",
                       "--mode", ",".join(cnn.MODES), "--no-progress", "--plot", "--sweep",
                       "--outdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for mode in cnn.MODES:
        assert f"{mode:>9} " in out
    assert "Modelled time" in out and "target: LM slow-memory writes" in out
    for f in ("resnet18_occupancy.png", "resnet18_traffic.png", "resnet18_sweep.png"):
        assert (tmp_path / f).stat().st_size > 1000


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


def test_benchmark_bad_input_lists_valid_names():
    bench = _bench()
    with pytest.raises(SystemExit, match="valid modes"):
        bench.main(["--mode", "LX", "--no-progress"])
    with pytest.raises(SystemExit, match="valid depths"):
        bench.main(["--model", "vgg", "--depth", "12", "--no-progress"])
    with pytest.raises(SystemExit, match="needs about"):
        bench.main(["--model", "vgg", "--depth", "11", "--batch", "2", "--image", "16",
                    "--width", "16", "--slow", "64KiB", "--no-progress"])
