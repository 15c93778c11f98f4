"""DenseNet's concatenation in place: one buffer per dense block, channel slices read and
written in place, the same training results as a copy per layer."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.models import cnn
from cachedarrays.models.backend import available_backends, get_backend

ONEDNN = pytest.mark.skipif("onednn" not in available_backends(), reason="libdnnl not loadable")
BACKENDS = ["numpy", pytest.param("onednn", marks=ONEDNN)]
F32 = np.float32
SHAPE = dict(batch=2, image=8, classes=5, width=16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_place_channels_writes_only_its_slice(backend):
    be = get_backend(backend)
    rng = np.random.default_rng(0)
    out = rng.standard_normal((2, 7, 3, 3)).astype(F32)
    keep = out.copy()
    x = rng.standard_normal((2, 3, 3, 3)).astype(F32)
    be.place_channels(x, 2, out)
    np.testing.assert_array_equal(out[:, 2:5], x)
    np.testing.assert_array_equal(out[:, :2], keep[:, :2])
    np.testing.assert_array_equal(out[:, 5:], keep[:, 5:])
    with pytest.raises(ValueError, match="channels 5..8"):
        be.place_channels(x, 5, out)


@pytest.mark.parametrize("numba", [True, False])
@ONEDNN
def test_onednn_batchnorm_reads_a_channel_prefix_in_place(numba):
    """A channel prefix of a larger NCHW buffer gives the results of its contiguous copy."""
    be = get_backend("onednn")
    old = be.set_numba_batchnorm(numba)
    try:
        rng = np.random.default_rng(1)
        buf = rng.standard_normal((3, 9, 4, 5)).astype(F32)
        c = 6
        g, b = rng.standard_normal(c).astype(F32), rng.standard_normal(c).astype(F32)
        dy = rng.standard_normal((3, c, 4, 5)).astype(F32)
        results = []
        for x in (buf[:, :c], np.ascontiguousarray(buf[:, :c])):
            y, m, v = np.empty((3, c, 4, 5), F32), np.empty(c, F32), np.empty(c, F32)
            be.batchnorm_relu_forward(x, g, b, 1e-5, y, m, v)
            dx, dg, db = np.empty_like(y), np.empty(c, F32), np.empty(c, F32)
            be.batchnorm_relu_backward(dy, y, x, g, m, v, 1e-5, dx, dg, db, acc=buf)
            z = np.empty_like(y)
            be.batchnorm_forward(x, g, b, 1e-5, z, m, v)
            dz = np.empty_like(y)
            be.batchnorm_backward(dy, x, g, m, v, 1e-5, dz, dg, db)
            results.append((y, dx, z, dz, dg, db))
        for a, b_ in zip(*results):
            np.testing.assert_array_equal(a, b_)
        assert not results[0][0].size or (results[0][0] >= 0).all()
    finally:
        be.set_numba_batchnorm(old)


def test_dense_block_layers_share_one_buffer():
    model = cnn.build("densenet", 121, **SHAPE)
    m = ca.Manager(fast="64MiB", slow="64MiB")
    s = cnn.Session(m, "numpy", dtype=F32)
    with m:
        model.init(s, seed=0)
        x, _ = cnn.synthetic_batch(model, 0)
        x = ca.asarray(x, manager=m)
        tape, outs = [], []
        for u in model.units:
            x, pb = s.rrule(u, x)
            tape.append(pb)
            outs.append((u, x))
        dense = [(u, y) for u, y in outs if isinstance(u, cnn.DenseLayer)]
        blocks = {}
        for u, y in dense:
            blocks.setdefault(u.name.split(".")[0], []).append((u, y))
            assert y.shape == u.buffer_shape
        assert len(blocks) == 4
        for layers in blocks.values():
            assert layers[0][0].first and not any(u.first for u, _ in layers[1:])
            assert len({id(y.object) for _, y in layers}) == 1          # one buffer
            assert layers[-1][0].out_shape == layers[-1][1].shape       # full when done
        with pytest.raises(ValueError, match="dense block's buffer"):
            dense[1][0].forward(s, ca.zeros(dense[1][0].in_shape, dtype=F32, manager=m))
        with pytest.raises(ValueError, match="block_channels"):
            cnn.DenseLayer("d", (2, 4, 3, 3), 2, block_channels=5)


def _mini_densenet(copies=False, batch=2, image=6, channels=3, classes=5, k=3):
    """Two dense blocks (3 and 2 layers) with a transition and a head: the DenseNet structure
    at a size that trains in milliseconds; copies: one buffer per layer."""
    shape = (batch, channels, image, image)
    units = []
    for b, n in enumerate((3, 2)):
        final = shape[1] + n * k
        for i in range(n):
            units.append(cnn.DenseLayer(f"dense{b}.{i}", shape, k, bn_size=2,
                                        block_channels=None if copies else final,
                                        first=copies or i == 0))
            shape = units[-1].out_shape
        if b == 0:
            conv = cnn.Conv2d("t.conv", shape, shape[1] // 2, 1)
            units.append(cnn.Chain("transition", [cnn.BatchNorm2d("t.bn", shape),
                                                  cnn.ReLU("t.relu", shape), conv,
                                                  cnn.AvgPool2d("t.pool", conv.out_shape, 2, 2)]))
            shape = units[-1].out_shape
    pool = cnn.AvgPool2d("head.pool", shape)
    flat = cnn.Flatten("head.flat", pool.out_shape)
    units += [pool, flat, cnn.Dense("head.fc", flat.out_shape, classes)]
    return cnn.Model("mini-densenet", units, (batch, channels, image, image), classes)


@pytest.mark.parametrize("backend,setup,budget", [
    ("numpy", "LM", "4KiB"), pytest.param("onednn", "LM", "4KiB", marks=ONEDNN),
    pytest.param("onednn", "2lm", "2KiB", marks=ONEDNN)])
def test_in_place_concatenation_trains_like_copies(backend, setup, budget):
    weights, losses = [], []
    for copies in (False, True):
        model = _mini_densenet(copies)
        m, s = cnn.make_session(setup, slow="16MiB", backend=backend,
                                **cnn.dram_budget(setup, budget))
        with m:
            model.init(s, seed=3)
            run = []
            for i in range(2):
                x, y = cnn.synthetic_batch(model, seed=i)
                run.append(cnn.train_step(s, model, x, y, cnn.SGD(0.05)))
            weights.append(model.weights())
            losses.append(run)
            if setup == "LM":
                assert m.stats()["moved"].get("fast->slow", {}).get("bytes", 0) > 0
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    for k in weights[0]:
        if backend == "onednn":      # the batch-norm kernels read a slice bitwise as its copy
            np.testing.assert_array_equal(weights[0][k], weights[1][k], err_msg=k)
        else:
            np.testing.assert_allclose(weights[0][k], weights[1][k], rtol=1e-5, atol=1e-6,
                                       err_msg=k)
