"""Fused batch norm + ReLU, DenseNet's in-kernel concatenation gradient, the measured choices
of the oneDNN backend (dense implementation, convolution layouts) and the walkers' type cache."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import annotations
from cachedarrays.models import cnn
from cachedarrays.models.backend import available_backends, get_backend

ONEDNN = pytest.mark.skipif("onednn" not in available_backends(), reason="libdnnl not loadable")
F32 = np.float32


def _read(a):
    with ca.readable(a) as v:
        return np.array(v)


def _bn_case(rng, shape=(2, 5, 3, 4), acc_channels=7):
    n, c, h, w = shape
    x = rng.standard_normal(shape).astype(F32)
    g, b = rng.standard_normal(c).astype(F32), rng.standard_normal(c).astype(F32)
    dy = rng.standard_normal(shape).astype(F32)
    acc = rng.standard_normal((n, acc_channels, h, w)).astype(F32)
    return x, g, b, dy, acc


@pytest.mark.parametrize("backend", ["numpy", pytest.param("onednn", marks=ONEDNN)])
def test_fused_batchnorm_relu_is_batchnorm_then_relu(backend):
    be, ref = get_backend(backend), get_backend("numpy")
    x, g, b, dy, acc = _bn_case(np.random.default_rng(0))
    c = x.shape[1]
    y, m, v = np.empty_like(x), np.empty(c, F32), np.empty(c, F32)
    be.batchnorm_relu_forward(x, g, b, 1e-5, y, m, v)
    y0, m0, v0 = np.empty_like(x), np.empty(c, F32), np.empty(c, F32)
    ref.batchnorm_forward(x, g, b, 1e-5, y0, m0, v0)
    ref.relu_forward(y0, y0)
    np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-5)
    assert (y >= 0).all() and (y == 0).any()
    # backward: the mask y > 0 applied to dy, then batch norm's gradients; acc adds its first C
    dz = np.empty_like(dy)
    ref.relu_backward(dy, y0, dz)
    dx0, dg0, db0 = np.empty_like(x), np.empty(c, F32), np.empty(c, F32)
    ref.batchnorm_backward(dz, x, g, m0, v0, 1e-5, dx0, dg0, db0)
    for extra in (None, acc):
        dx, dg, db = np.empty_like(x), np.empty(c, F32), np.empty(c, F32)
        be.batchnorm_relu_backward(dy, y, x, g, m, v, 1e-5, dx, dg, db, acc=extra)
        want = dx0 if extra is None else dx0 + extra[:, :c]
        np.testing.assert_allclose(dx, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dg, dg0, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(db, db0, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="acc"):
        be.batchnorm_relu_backward(dy, y, x, g, m, v, 1e-5, dx, dg, db, acc=acc[:, :c - 1])
    out = np.empty((2, 3, 3, 4), F32)
    be.slice_channels(acc, 2, out)
    np.testing.assert_array_equal(out, acc[:, 2:5])
    with pytest.raises(ValueError, match="channels 5..8"):
        be.slice_channels(acc, 5, out)


@ONEDNN
def test_dense_layer_on_onednn_matches_numpy_through_cachedarrays():
    shape = (2, 16, 4, 4)
    outs = {}
    for be in ("numpy", "onednn"):
        layer = cnn.DenseLayer("dl", shape, growth=4, bn_size=2)
        m = ca.Manager(fast="256KiB", slow="64MiB", policy="lru")
        s = cnn.Session(m, be, dtype=F32)
        with m:
            layer.init(s, np.random.default_rng(0))
            rng = np.random.default_rng(1)
            x = ca.asarray(rng.standard_normal(shape, dtype=F32), manager=m)
            y, pb = s.rrule(layer, x)
            yv = _read(y)
            dy = rng.standard_normal(layer.out_shape, dtype=F32)
            dx = _read(pb(ca.asarray(dy, manager=m)))
            outs[be] = [yv, dx] + [_read(p.grad) for p in layer.params()]
    for a, b in zip(outs["numpy"], outs["onednn"]):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)


@ONEDNN
def test_onednn_measures_dense_and_convolution_choices_once_per_shape():
    dnnl, ref = get_backend("onednn"), get_backend("numpy")
    rng = np.random.default_rng(2)
    x, w, b = (rng.standard_normal(s).astype(F32) for s in ((3, 7), (5, 7), (5,)))
    want = x @ w.T + b
    for impl in ("numpy", "onednn", "auto"):
        old = dnnl.set_dense_impl(impl)
        try:
            out = np.empty((3, 5), F32)
            dnnl.dense_forward(x, w, b, out)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
            if impl == "auto":
                assert dnnl.dense_choices()[("dense_forward", (3, 7), (5, 7), True, False)] in (
                    "numpy", "onednn")
        finally:
            dnnl.set_dense_impl(old)
    with pytest.raises(ValueError, match="auto, onednn, numpy"):
        dnnl.set_dense_impl("blas")
    cx, cw = rng.standard_normal((2, 3, 6, 6)).astype(F32), rng.standard_normal((4, 3, 3, 3)).astype(F32)
    want = np.empty((2, 4, 6, 6), F32)
    ref.conv2d_forward(cx, cw, None, 1, 1, want)
    for mode in ("rule", "auto"):
        old = dnnl.set_conv_layouts(mode)
        try:
            out = np.empty_like(want)
            dnnl.conv2d_forward(cx, cw, None, 1, 1, out)
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
            chosen = dnnl.conv_layout_choices()
            assert (("conv2d_forward", cx.shape, cw.shape, False, (1, 1), (1, 1)) in chosen) == (
                mode == "auto")
        finally:
            dnnl.set_conv_layouts(old)


class _Holder:
    def __init__(self, a):
        self.a = a


def test_walkers_cache_kinds_per_type_and_forget_them_on_register_leaf_type():
    m = ca.Manager(fast="1MiB", slow="4MiB", policy="lru")
    with m:
        a = ca.asarray(np.zeros(4), manager=m)

        class Box:                    # a new type: its kind is computed on first sight
            def __init__(self, v):
                self.v = v

        assert len(ca.arrays_in(Box(a), [_Holder(a)], {"k": (a,)})) == 1
        assert annotations._KINDS[Box] == annotations._OBJ
        ca.register_leaf_type(Box)    # from now on never looked inside
        assert Box not in annotations._KINDS
        assert ca.arrays_in(Box(a)) == [] and len(ca.arrays_in(_Holder(a))) == 1
        ca.unsafe_free(a)
