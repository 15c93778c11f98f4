"""DLRM: one training step against an independent NumPy reference, table kinds agree, loss falls."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.models.backend import available_backends
from cachedarrays.models.dlrm import configs
from cachedarrays.models.dlrm.data import Batch
from cachedarrays.models.dlrm.model import (DLRM, bce_with_logits, dot_interaction,
                                            dot_interaction_backward, synthetic_dataset)
from helpers import load_benchmark


def random_batch(cfg, seed=0, distribution="uniform"):
    return synthetic_dataset(cfg, distribution, seed=seed).batch(0)

BACKENDS = available_backends()


@pytest.fixture
def m():
    with ca.Manager(fast="64MiB", slow="256MiB") as manager:
        yield manager


def _pairs(f):
    return [i for i in range(f) for j in range(i)], [j for i in range(f) for j in range(i)]


def _bag_sum(table, idx, off):
    ends = np.append(off[1:], len(idx))
    return np.stack([table[idx[s:e]].sum(0) for s, e in zip(off, ends)])


def reference_step(params, cfg, batch, lr):
    """Loss and updated parameters of one SGD step, in float64, written from the formulas."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    nb, nt, d, b = len(cfg.bottom), len(cfg.top), cfg.featuresize, batch.batch_size
    xs = [batch.dense.astype(np.float64)]
    for i in range(nb):
        xs.append(np.maximum(xs[-1] @ p[f"bottom.{i}.weight"].T + p[f"bottom.{i}.bias"], 0))
    embs = [_bag_sum(p[f"emb.{t}"], batch.indices[t], batch.offsets[t]) for t in range(cfg.ntables)]
    t_all = np.concatenate([xs[-1]] + embs, axis=1)
    f = cfg.ntables + 1
    li, lj = _pairs(f)
    if cfg.interaction == "dot":
        tr = t_all.reshape(b, f, d)
        z = tr @ tr.transpose(0, 2, 1)
        r = np.concatenate([xs[-1], z[:, li, lj]], axis=1)
    else:
        r = t_all
    hs = [r]
    for i in range(nt):
        h = hs[-1] @ p[f"top.{i}.weight"].T + p[f"top.{i}.bias"]
        hs.append(np.maximum(h, 0) if i < nt - 1 else h)
    prob = 1 / (1 + np.exp(-hs[-1][:, 0]))
    y = batch.labels.astype(np.float64)
    loss = -np.mean(y * np.log(prob) + (1 - y) * np.log(1 - prob))
    new = dict(p)
    dy = ((prob - y) / b)[:, None]
    for i in range(nt - 1, -1, -1):
        if i < nt - 1:
            dy = dy * (hs[i + 1] > 0)
        new[f"top.{i}.weight"] = p[f"top.{i}.weight"] - lr * dy.T @ hs[i]
        new[f"top.{i}.bias"] = p[f"top.{i}.bias"] - lr * dy.sum(0)
        dy = dy @ p[f"top.{i}.weight"]
    if cfg.interaction == "dot":
        dz = np.zeros((b, f, f))
        dz[:, li, lj] = dy[:, d:]
        dt = ((dz + dz.transpose(0, 2, 1)) @ tr).reshape(b, f * d)
        dt[:, :d] += dy[:, :d]
    else:
        dt = dy
    for t in range(cfg.ntables):
        g = np.zeros_like(p[f"emb.{t}"])
        idx, off = batch.indices[t], batch.offsets[t]
        bag = np.repeat(np.arange(b), np.diff(np.append(off, len(idx))))
        np.add.at(g, idx, dt[bag, d * (t + 1):d * (t + 2)])
        new[f"emb.{t}"] = p[f"emb.{t}"] - lr * g
    dy = dt[:, :d]
    for i in range(nb - 1, -1, -1):
        dy = dy * (xs[i + 1] > 0)
        new[f"bottom.{i}.weight"] = p[f"bottom.{i}.weight"] - lr * dy.T @ xs[i]
        new[f"bottom.{i}.bias"] = p[f"bottom.{i}.bias"] - lr * dy.sum(0)
        dy = dy @ p[f"bottom.{i}.weight"]
    return loss, prob, new


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interaction", ["dot", "cat"])
def test_training_step_equals_numpy_reference(m, backend, interaction):
    cfg = configs.tiny(interaction=interaction, lr=0.5)
    model = DLRM(cfg, manager=m, backend=backend, table_kind="dynamic", cache=0.3, page_rows=8)
    for step in range(2):
        batch = random_batch(cfg, seed=step)
        before = model.state_dict()
        loss_ref, prob_ref, after_ref = reference_step(before, cfg, batch, cfg.lr)
        np.testing.assert_allclose(model.predict(batch), prob_ref, rtol=1e-5, atol=1e-6)
        loss = model.train_step(batch)
        assert loss == pytest.approx(loss_ref, rel=1e-5)
        after = model.state_dict()
        assert after.keys() == after_ref.keys()
        for k in after:
            np.testing.assert_allclose(after[k], after_ref[k], rtol=1e-4, atol=2e-6,
                                       err_msg=f"{k} after step {step}")
    assert all(len(v) == 2 for v in model.timings.values())


def test_table_kinds_train_identically(m):
    cfg = configs.tiny(lr=0.3)
    batches = [random_batch(cfg, seed=s, distribution=d) for s, d in
               zip(range(6), ["uniform", "zipf"] * 3)]
    runs = {}
    for kind in ("fast", "simple", "static", "dynamic"):
        model = DLRM(cfg, manager=m, backend="numpy", table_kind=kind, cache=0.2, page_rows=4)
        assert model.table_kind == kind
        runs[kind] = (model.train(batches), model.state_dict())
        if kind == "dynamic":
            s = model.table_stats()
            assert s["rows_cached"] > 0 and s["flushes"] > 0 and 0 < s["hit_rate"] < 1
            for t in model.tables:
                t.check()
    for kind, (losses, state) in runs.items():
        np.testing.assert_allclose(losses, runs["fast"][0], rtol=1e-6, err_msg=kind)
        for k in state:
            np.testing.assert_allclose(state[k], runs["fast"][1][k], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{kind} {k}")


MLP_KERNELS = {"load_dense_input", "dense_forward", "copy_bottom_features", "dot_interaction",
               "bce_with_logits", "relu_backward_bias", "dense_backward_weights",
               "output_layer_backward", "dense_backward_data", "dot_interaction_backward",
               "copy_bottom_gradient", "sgd_update"}


@pytest.mark.parametrize("kind", ["fast", "simple", "static", "dynamic"])
def test_a_traced_training_run_has_named_kernels_and_a_step_mark_per_step(m, kind):
    cfg = configs.tiny(lr=0.3)
    model = DLRM(cfg, manager=m, backend="numpy", table_kind=kind, cache=0.2, page_rows=4)
    batches = [random_batch(cfg, seed=s, distribution="zipf") for s in range(3)]
    with ca.trace(m) as t:
        model.train(batches)
    t.validate()
    assert t.steps == 3
    groups = t.step_kernels()
    assert len(groups) == 3
    for g in groups:
        names = [t.kernels[k][0] for k in g]
        assert set(names) <= MLP_KERNELS | {"embedding_lookup", "embedding_update",
                                            "embedding_writeback", "embedding_cache_rows"}
        assert {"dense_forward", "embedding_lookup", "embedding_update", "sgd_update",
                "output_layer_backward"} <= set(names)
        # One ensemble lookup and update; nested in each, one kernel for all the cached
        # tables together.
        cached = kind in ("static", "dynamic")
        assert names.count("embedding_lookup") == names.count("embedding_update") == 1 + cached
    lookups = [t.kernels[k] for k in groups[-1] if t.kernels[k][0] == "embedding_lookup"]
    assert lookups[0][2]                                # the ensemble kernel writes the features
    if kind in ("fast", "simple"):                      # and reads every table
        assert len(lookups[0][1]) == cfg.ntables
    else:                                               # the cached tables' kernel: every base
        assert len(lookups[1][1]) == 2 * cfg.ntables    # and every pool


def test_loss_falls_on_learnable_synthetic_data(m):
    cfg = configs.tiny(batch_size=256, lr=0.5)
    model = DLRM(cfg, manager=m, table_kind="dynamic", backend=BACKENDS[-1])
    losses = []
    for step in range(40):
        batch = random_batch(cfg, seed=100 + step)
        signal = batch.dense[:, 0] + (batch.indices[0][::cfg.bag_size] % 2) - 0.5
        batch.labels = (signal > 0).astype(np.float32)
        losses.append(model.train_step(batch))
    assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5])


def test_interaction_kernels_match_formula():
    rng = np.random.default_rng(0)
    b, f, d = 5, 4, 3
    t = rng.standard_normal((b, f * d)).astype(np.float32)
    r = dot_interaction(t, f, d)
    tr = t.reshape(b, f, d)
    li, lj = _pairs(f)
    assert r.shape == (b, d + 6)
    np.testing.assert_allclose(r[:, d:], (tr @ tr.transpose(0, 2, 1))[:, li, lj], rtol=1e-6)
    dr = rng.standard_normal(r.shape).astype(np.float32)
    dt = dot_interaction_backward(t, dr, f, d)
    eps, k = 1e-3, (2, 7)                       # a finite difference of <dr, r(t)>
    tp, tm = t.astype(np.float64), t.astype(np.float64)
    tp = tp.copy(); tp[k] += eps
    tm = tm.copy(); tm[k] -= eps
    fd = ((dot_interaction(tp, f, d) * dr).sum() - (dot_interaction(tm, f, d) * dr).sum()) / (2 * eps)
    assert dt[k] == pytest.approx(fd, rel=1e-3)


@pytest.mark.parametrize("f, d, dtype", [(4, 3, np.float32), (27, 16, np.float32),
                                         (9, 64, np.float64)])
def test_specialised_interaction_is_bit_identical_to_the_generic_kernel(f, d, dtype, specialised):
    from cachedarrays.models.dlrm import model

    t = np.random.default_rng(f).standard_normal((70, f * d)).astype(dtype)
    special = dot_interaction(t, f, d)
    assert model._specialised(f, d, t, special) is not None
    old = model.set_specialised(False)
    try:
        generic = dot_interaction(t, f, d)
    finally:
        model.set_specialised(old)
    np.testing.assert_array_equal(special, generic)
    assert model._specialised(f, d, t, special) is model._specialised(f, d, t, special)


def test_bce_matches_torch_and_clamps():
    torch = pytest.importorskip("torch")
    z = np.array([[-3.0], [0.0], [2.5], [40.0]], np.float32)
    y = np.array([0, 1, 1, 0], np.float32)
    dz = np.empty_like(z)
    loss = bce_with_logits(z, y, dz)
    zt = torch.tensor(z, requires_grad=True)
    lt = torch.nn.BCELoss()(torch.sigmoid(zt)[:, 0], torch.tensor(y))
    lt.backward()
    assert loss == pytest.approx(lt.item(), rel=1e-6)
    np.testing.assert_allclose(dz, zt.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_configs_follow_the_tables():
    s, lg, t6 = configs.small(), configs.large(), configs.table56()
    assert (s.featuresize, s.bottom, s.top, s.batch_size) == (16, (512, 256, 64, 16), (512, 256, 1), 8192)
    assert (lg.featuresize, lg.bottom, lg.top, lg.batch_size) == \
        (128, (512, 256, 128), (1024, 1024, 512, 256, 1), 32768)
    assert s.ntables == lg.ntables == 26 and max(s.table_sizes) == 10131227
    assert s.interaction_width == 16 + 27 * 26 // 2
    assert (t6.ntables, t6.table_sizes[0], t6.featuresize, t6.bag_size, t6.batch_size) == \
        (64, 6_000_000, 256, 100, 512)
    assert len(t6.bottom) == 8 and len(t6.top) == 16 and t6.top[0] == 4096
    shrunk = configs.small(scale=0.001, width_scale=0.25)
    assert max(shrunk.table_sizes) == 10131 and min(shrunk.table_sizes) == 3
    assert shrunk.bottom == (128, 64, 16, 16) and shrunk.top == (128, 64, 1)
    with pytest.raises(ValueError, match="must end in featuresize"):
        configs.DLRMConfig("bad", (10,), 16, (32, 8), (4, 1), 8)
    with pytest.raises(ValueError, match="unknown DLRM config 'huge'"):
        configs.get_config("huge")


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -0.1, "0.1", 1e39, 10**400])
def test_a_bad_learning_rate_is_refused_before_any_parameter_changes(m, lr):
    cfg = configs.tiny()
    model = DLRM(cfg, manager=m, backend="numpy")
    before = [np.asarray(layer.w) for layer in model.bottom + model.top]
    tables = [np.asarray(t.snapshot()) for t in model.tables]
    with pytest.raises((ValueError, TypeError), match="learning rate"):
        model.train_step(random_batch(cfg), lr=lr)
    for layer, w in zip(model.bottom + model.top, before):
        np.testing.assert_array_equal(np.asarray(layer.w), w)
    for t, values in zip(model.tables, tables):
        np.testing.assert_array_equal(np.asarray(t.snapshot()), values)
    assert np.isfinite(model.train_step(random_batch(cfg)))


def test_bad_batches_are_refused(m):
    cfg = configs.tiny()
    model = DLRM(cfg, manager=m, backend="numpy")
    good = random_batch(cfg)
    with pytest.raises(ValueError, match="dense input has shape"):
        model.train_step(Batch(good.dense[:, :5], good.indices, good.offsets, good.labels))
    with pytest.raises(ValueError, match="3 index arrays for 4 tables"):
        model.train_step(Batch(good.dense, good.indices[:3], good.offsets[:3], good.labels))
    with pytest.raises(ValueError, match="'emb.1'.*equal bags"):
        model.train_step(Batch(good.dense, [good.indices[0], good.indices[1][:-1]] + good.indices[2:],
                               None, good.labels))
    bad = [i.copy() for i in good.indices]
    bad[2][5] = cfg.table_sizes[2]
    with pytest.raises(IndexError, match=f"'emb.2'.*index {cfg.table_sizes[2]} at position 5"):
        model.train_step(Batch(good.dense, bad, good.offsets, good.labels))
    with pytest.raises(ValueError, match="unknown table kind 'lru'"):
        DLRM(cfg, manager=m, table_kind="lru")
    with pytest.raises(TypeError):          # "policy" names only the manager's placement policy
        DLRM(cfg, manager=m, policy="dynamic")


def _load_benchmark():
    return load_benchmark("dlrm")


def test_torch_peer_trains_to_the_same_losses(m):
    pytest.importorskip("torch")
    bench = _load_benchmark()
    cfg = configs.tiny(lr=0.3)
    model = DLRM(cfg, manager=m, backend=BACKENDS[-1], table_kind="dynamic")
    peer = bench.TorchDLRM(cfg, model.state_dict())
    batches = [random_batch(cfg, seed=s) for s in range(8)]
    ours = model.train(batches)
    theirs = [peer.train_step(b, cfg.lr) for b in batches]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)


def test_demo_returns_losses_hit_rate_and_stats():
    from cachedarrays.models.dlrm import demo
    r = demo(iterations=3)
    assert r["table_kind"] == "dynamic"
    assert len(r["losses"]) == 3 and 0 <= r["hit_rate"] <= 1
    assert "moved" in r["manager"] and set(r["phases"]) == {"lookup", "interaction", "mlp", "update"}


@pytest.mark.parametrize("nfeat,fs,dtype", [(5, 8, np.float32)])    # the tiny config's shape
def test_specialised_interaction_backward_is_bit_identical_to_generic(nfeat, fs, dtype,
                                                                     specialised):
    from cachedarrays.models.dlrm import model as M
    rng = np.random.default_rng(nfeat + fs)
    b = 67                                      # not a multiple of the kernels' sample blocks
    t = rng.standard_normal((b, nfeat * fs)).astype(dtype)
    dr = rng.standard_normal((b, fs + nfeat * (nfeat - 1) // 2)).astype(dtype)
    dt = np.full_like(t, np.nan)                # every element must be written
    assert M._specialised(nfeat, fs, t, dr, dt, backward=True) is not None
    dot_interaction_backward(t, dr, nfeat, fs, dt)
    old = M.set_specialised(False)
    try:
        generic = dot_interaction_backward(t, dr, nfeat, fs)
    finally:
        M.set_specialised(old)
    assert np.array_equal(dt, generic)
    assert M._specialised(nfeat, fs, t, dr[:, 1:].copy(), dt, backward=True) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fma_rounds_once(dtype):
    """The interaction kernels' fma: (1 + e)(1 - e) - 1 is -e**2 exactly, which a multiply
    rounded before the add loses (the product rounds to 1)."""
    from numba import njit

    from cachedarrays.models.dlrm._intrinsics import fma

    e = dtype(2.0 ** -(13 if dtype == np.float32 else 30))
    one = dtype(1)
    fused = njit(lambda a, b, c: fma(a, b, c))(one + e, one - e, -one)
    assert fused == -(e * e) and fused != 0
    assert (one + e) * (one - e) - one == 0         # what two roundings give


def _far():
    from cachedarrays.models.dlrm import _intrinsics
    return _intrinsics.FAR_LOCALITY


@pytest.mark.parametrize("hint, rw, locality", [("prefetch_read", 0, 3), ("prefetch_write", 1, 3),
                                                ("prefetch_read_l2", 0, 2),
                                                ("prefetch_far", 0, None)])
def test_prefetch_hints_emit_their_cache_level_and_never_fault(hint, rw, locality):
    """Each hint is one ``llvm.prefetch`` with its read/write flag and cache level (the far
    hint's level is this CPU's, see ``far_locality``), and a hint past the end of the array
    is harmless."""
    locality = _far() if locality is None else locality
    import re

    from numba import njit

    from cachedarrays.models.dlrm import _intrinsics

    fn = getattr(_intrinsics, hint)

    @njit(cache=False)
    def touch(a, i):
        fn(a, i)
        return a[0]

    a = np.ones(16, dtype=np.float32)
    assert touch(a, np.uint64(1 << 40)) == 1.0       # far outside the array: no fault
    ir = next(iter(touch.inspect_llvm().values()))
    calls = re.findall(r"call void @llvm\.prefetch\.p0\(ptr [^,]+, i32 (\d), i32 (\d), i32 1\)", ir)
    assert calls == [(str(rw), str(locality))]


@pytest.mark.parametrize("cpu, locality", [("znver5", 3), ("znver4", 3), ("sapphirerapids", 2),
                                           ("skylake-avx512", 2), ("generic", 2)])
def test_far_hints_go_to_l1_on_zen_and_to_l2_elsewhere(cpu, locality):
    """Far-ahead row and ``where`` hints: into L1 on AMD Zen (measured faster there), into L2
    on other CPUs (a Xeon's L1 miss buffers fill); the machine's own choice is its CPU's."""
    import llvmlite.binding as llvm
    import numba

    from cachedarrays.models.dlrm._intrinsics import FAR_LOCALITY, far_locality

    assert far_locality(cpu) == locality
    own = numba.config.CPU_NAME
    own = llvm.get_host_cpu_name() if not own or own == "host" else own
    assert FAR_LOCALITY == far_locality(own) == far_locality()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_row_sums_are_512_bit_vectors_with_a_scalar_loops_sums(dtype, k):
    """``add_rows<k>`` adds k rows to an accumulator in 512-bit vectors (16 float32 or 8
    float64 lanes) and in the order a scalar loop adds them, so every sum is bit for bit
    that loop's; it touches exactly the first n elements."""
    import re

    from numba import njit

    from cachedarrays.models.dlrm import _intrinsics

    fn = getattr(_intrinsics, f"add_rows{k}")
    lanes = _intrinsics.ROW_LANES[np.dtype(dtype).itemsize]

    @njit(cache=False)
    def add(acc, t, p, n):
        if k == 1:
            fn(acc, t, p[0], n)
        elif k == 4:
            fn(acc, t, p[0], p[1], p[2], p[3], n)
        else:
            fn(acc, t, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], n)

    rng = np.random.default_rng(k)
    fs = 3 * lanes
    t = (rng.standard_normal(40 * fs) * 10.0 ** rng.integers(-6, 6, 40 * fs)).astype(dtype)
    p = (rng.integers(0, 39, 8) * fs + rng.integers(0, fs, 8)).astype(np.uint64)  # unaligned rows
    for n in (0, lanes, 2 * lanes, fs):
        acc = rng.standard_normal(fs + 5).astype(dtype)
        want = acc.copy()
        for q in p[:k]:
            want[:n] = want[:n] + t[int(q):int(q) + n]       # one row at a time, in order
        add(acc, t, p, np.uint64(n))
        assert np.array_equal(acc, want)
    ir = next(iter(add.inspect_llvm().values()))
    widths = re.findall(r"fadd (?:fast )?<(\d+) x (?:float|double)>", ir)
    assert len(widths) >= k and set(widths) == {str(lanes)}     # k per vector, no narrower


@pytest.mark.parametrize("n, h", [(1, 1), (255, 7), (256, 64), (257, 33), (1000, 16)])
def test_output_layer_backward_equals_the_separate_kernels(n, h):
    """One pass gives what the weight and data gradients and the ReLU's backward pass give
    (the input gradient bit for bit), across row chunks and with ReLU zeros."""
    from cachedarrays.models.dlrm._head import output_layer_backward

    rng = np.random.default_rng(n + h)
    dz = rng.standard_normal((n, 1)).astype(np.float32)
    y = np.maximum(rng.standard_normal((n, h)), 0).astype(np.float32)
    w = rng.standard_normal((1, h)).astype(np.float32)
    dx, dw = np.full((n, h), np.nan, np.float32), np.full((1, h), np.nan, np.float32)
    db, dbp = np.full(1, np.nan, np.float32), np.full(h, np.nan, np.float32)
    assert output_layer_backward(dz, y, w, dx, dw, db, dbp) is dx
    expect_dx = np.where(y > 0, dz * w, np.float32(0))
    assert np.array_equal(dx, expect_dx)
    d64, y64 = dz.astype(np.float64), y.astype(np.float64)
    np.testing.assert_allclose(dw, d64.T @ y64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db, d64.sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dbp, expect_dx.astype(np.float64).sum(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [4, 600])           # serial and parallel kernels
def test_output_layer_backward_compiles_once_for_read_only_or_writable_inputs(n):
    """Inputs from a read scope (read-only) and fresh ones reach the kernel as one numba type."""
    from cachedarrays.models.dlrm import _head

    rng = np.random.default_rng(n)
    h = 16
    inputs = [rng.standard_normal(s).astype(np.float32) for s in ((n, 1), (n, h), (1, h))]
    results = []
    for frozen in (False, True):
        if frozen:
            seen = [tuple(k.signatures) for k in (_head._output_layer_backward,
                                                   _head._output_layer_backward_serial)]
            for a in inputs:
                a.flags.writeable = False
        out = [np.empty((n, h), np.float32), np.empty((1, h), np.float32),
               np.empty(1, np.float32), np.empty(h, np.float32)]
        _head.output_layer_backward(*inputs, *out)
        results.append(out)
    assert [tuple(k.signatures) for k in (_head._output_layer_backward,
                                          _head._output_layer_backward_serial)] == seen
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_output_layer_backward_refuses_bad_arguments():
    from cachedarrays.models.dlrm._head import output_layer_backward

    n, h = 8, 4
    good = dict(dz=np.ones((n, 1), np.float32), y=np.ones((n, h), np.float32),
                w=np.ones((1, h), np.float32), dx=np.empty((n, h), np.float32),
                dw=np.empty((1, h), np.float32), db=np.empty(1, np.float32),
                dbp=np.empty(h, np.float32))
    bad = {"dz": np.ones((n, 2), np.float32), "y": np.ones((n, h), np.float64),
           "w": np.ones((h, 1), np.float32), "dx": np.empty((n, 2 * h), np.float32)[:, ::2],
           "dw": [0.0] * h, "dbp": np.empty(h + 1, np.float32)}
    for name, value in bad.items():
        with pytest.raises(ValueError, match=f"{name} must be"):
            output_layer_backward(**dict(good, **{name: value}))
    ro = np.empty((n, h), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="dx is read-only"):
        output_layer_backward(**dict(good, dx=ro))
    empty = dict(good, dz=np.ones((0, 1), np.float32), y=np.ones((0, h), np.float32),
                 dx=np.empty((0, h), np.float32))
    output_layer_backward(**empty)
    assert (empty["dw"] == 0).all() and (empty["db"] == 0).all() and (empty["dbp"] == 0).all()


# ---- small batches on the calling thread -----------------------------------------------------


@pytest.mark.parametrize("specialise", [True, False], ids=["specialised", "generic"])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_interaction_on_the_calling_thread_is_bit_identical_to_the_parallel_kernel(
        monkeypatch, specialise, n):
    """Batches of at most SERIAL_SAMPLES run the kernels' serial twins: forward and backward
    give the parallel kernels' results bit for bit, on both sides of the threshold."""
    from cachedarrays.models.dlrm import model

    f, d = 4, 3                        # a shape other tests compile too
    rng = np.random.default_rng(n)
    t = rng.standard_normal((n, f * d)).astype(np.float32)
    dr = rng.standard_normal((n, d + f * (f - 1) // 2)).astype(np.float32)
    old = model.set_specialised(specialise)
    try:
        got = {}
        for serial in (0, 1 << 40):
            monkeypatch.setattr(model, "SERIAL_SAMPLES", serial)
            got[serial] = (dot_interaction(t, f, d), dot_interaction_backward(t, dr, f, d))
    finally:
        model.set_specialised(old)
    for a, b in zip(got[0], got[1 << 40]):
        assert np.array_equal(a, b)


def test_small_batches_pick_the_serial_interaction_kernels(specialised):
    from cachedarrays.models.dlrm import model

    small = np.ones((model.SERIAL_SAMPLES, 12), np.float32)
    big = np.ones((model.SERIAL_SAMPLES + 1, 12), np.float32)
    dot_interaction(small, 4, 3)                       # builds the shape's kernels
    forward, backward, forward_serial, backward_serial = model._kernels[(4, 3)]
    for t, want in ((small, forward_serial), (big, forward)):
        assert model._specialised(4, 3, t, dot_interaction(t, 4, 3)) is want
    dr = np.ones((small.shape[0], 3 + 6), np.float32)
    assert model._specialised(4, 3, small, dr, np.empty_like(small),
                              backward=True) is backward_serial


@pytest.mark.parametrize("n", [1, 256, 257, 700])
def test_output_layer_backward_on_the_calling_thread_matches_the_parallel_kernel(monkeypatch, n):
    from cachedarrays.layout import readonly_view
    from cachedarrays.models.dlrm import _head

    rng = np.random.default_rng(n)
    h = 24
    dz = rng.standard_normal((n, 1)).astype(np.float32)
    y = np.maximum(rng.standard_normal((n, h)), 0).astype(np.float32)
    w = rng.standard_normal((1, h)).astype(np.float32)
    inputs = [readonly_view(a) for a in (dz.reshape(n), y, w.reshape(h))]   # as the wrapper
    got = []
    for kernel in (_head._output_layer_backward, _head._output_layer_backward_serial):
        dx, dw = np.empty((n, h), np.float32), np.empty(h, np.float32)
        db, dbp = np.empty(1, np.float32), np.empty(h, np.float32)
        kernel(*inputs, dx, dw, db, dbp)
        got.append((dx, dw, db, dbp))
    for a, b in zip(*got):
        assert np.array_equal(a, b)
    used = []
    for name in ("_output_layer_backward", "_output_layer_backward_serial"):
        monkeypatch.setattr(_head, name, lambda *a, name=name: used.append(name))
    _head.output_layer_backward(dz, y, w, np.empty((n, h), np.float32),
                                np.empty((1, h), np.float32), np.empty(1, np.float32),
                                np.empty(h, np.float32))
    assert used == ["_output_layer_backward_serial" if n <= _head.CHUNK_ROWS
                    else "_output_layer_backward"]
