"""Compute backends: NumPy reference against finite differences, oneDNN against the reference."""

import threading
import weakref

import numpy as np
import pytest

from cachedarrays.models import backend as backends
from cachedarrays.models.backend import _checks, _dnnl_api
from cachedarrays.models.backend import reference as ref

F32 = np.float32


@pytest.fixture(scope="module")
def dnnl():
    try:
        return backends.get_backend("onednn")
    except ImportError as exc:
        pytest.skip(f"oneDNN backend unavailable: {exc}")


@pytest.fixture(params=["numpy", "onednn"])
def any_backend(request):
    try:
        return backends.get_backend(request.param)
    except ImportError as exc:
        pytest.skip(f"{request.param} backend unavailable: {exc}")


def rand(rng, *shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


def close(actual, expected):
    """float32 agreement: rtol 1e-4, atol 1e-5 scaled by the expected magnitude."""
    scale = max(1.0, float(np.max(np.abs(expected)))) if np.size(expected) else 1.0
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * scale)


# --- geometry used across tests -------------------------------------------------------------

CONV_CASES = [
    # N, C, H, W, K, R, S, stride, pad
    (2, 3, 7, 9, 4, 3, 3, 1, 1),
    (3, 2, 8, 7, 5, 3, 2, 2, 0),
    (1, 4, 11, 10, 3, 5, 5, 3, 2),
    (2, 3, 5, 5, 2, 1, 1, 1, 0),
    (2, 5, 9, 6, 6, 3, 3, (2, 1), (1, 0)),
    (1, 16, 12, 12, 8, 3, 3, 2, 1),
    (2, 32, 4, 4, 48, 1, 1, 1, 0),      # 1x1 kernels with blocked weights: 2-D weight reorders
    (1, 64, 5, 5, 32, 1, 1, 2, 0),
    (1, 16, 32, 32, 16, 3, 3, 1, 1),    # 32x32 output pixels, 16 channels: channels-last
]

POOL_CASES = [
    # N, C, H, W, kernel, stride, pad
    (2, 3, 7, 9, 3, 2, 1),
    (2, 3, 8, 8, 2, 2, 0),
    (1, 2, 7, 7, 3, 1, 1),
    (2, 2, 5, 6, 5, 5, 2),
    (2, 4, 9, 7, (3, 2), (2, 1), (1, 0)),
    (1, 2, 17, 16, 16, 1, 0),  # 256-element window: oneDNN switches its workspace to int32
]


def conv_arrays(rng, case, dtype=F32):
    n, c, h, w, k, r, s, stride, pad = case
    x, wt, b = rand(rng, n, c, h, w, dtype=dtype), rand(rng, k, c, r, s, dtype=dtype), rand(rng, k, dtype=dtype)
    out_shape = ref.conv2d_output_shape(x.shape, wt.shape, stride, pad)
    return x, wt, b, stride, pad, out_shape


# --- backend selection ----------------------------------------------------------------------

def test_get_backend_names_and_unknown_name_lists_valid_ones():
    assert backends.get_backend("numpy") is ref
    assert "numpy" in backends.available_backends()
    with pytest.raises(ValueError, match="numpy, onednn"):
        backends.get_backend("cuda")


def test_available_backends_leaves_out_backends_that_fail_to_load(monkeypatch):
    monkeypatch.setitem(backends._MODULES, "broken", "_no_such_backend_module")
    assert "broken" not in backends.available_backends()
    with pytest.raises(ImportError):
        backends.get_backend("broken")


def test_every_backend_implements_the_protocol(any_backend):
    wanted = [n for n in vars(backends.Backend) if not n.startswith("_") and callable(getattr(backends.Backend, n))]
    missing = [n for n in wanted if not callable(getattr(any_backend, n, None))]
    assert len(wanted) >= 22 and missing == []


# --- NumPy reference against central finite differences (float64) ---------------------------

def numeric_grad(f, a, eps=1e-6):
    """d f() / d a by central differences, perturbing a in place."""
    g = np.zeros_like(a)
    flat, gflat = a.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        up = f()
        flat[i] = old - eps
        down = f()
        flat[i] = old
        gflat[i] = (up - down) / (2 * eps)
    return g


def fd_close(analytic, numeric):
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", [CONV_CASES[0], CONV_CASES[1], CONV_CASES[4]])
def test_reference_conv_gradients_match_finite_differences(case):
    rng = np.random.default_rng(1)
    n, c, h, w, k, r, s, stride, pad = case
    case = (n, min(c, 2), h, w, min(k, 3), r, s, stride, pad)
    x, wt, b, stride, pad, oshape = conv_arrays(rng, case, np.float64)
    proj = rand(rng, *oshape, dtype=np.float64)
    out = np.empty(oshape)

    def loss():
        return float(np.sum(ref.conv2d_forward(x, wt, b, stride, pad, out) * proj))

    dx, dw, db = np.empty_like(x), np.empty_like(wt), np.empty_like(b)
    ref.conv2d_backward_data(proj, wt, stride, pad, dx)
    ref.conv2d_backward_weights(x, proj, stride, pad, dw, db)
    fd_close(dx, numeric_grad(loss, x))
    fd_close(dw, numeric_grad(loss, wt))
    fd_close(db, numeric_grad(loss, b))


@pytest.mark.parametrize("case", POOL_CASES)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_reference_pooling_gradients_match_finite_differences(case, kind):
    rng = np.random.default_rng(2)
    n, c, h, w, kernel, stride, pad = case
    x = rand(rng, 1, c, h, w, dtype=np.float64)
    oshape = _checks.pool_output_shape(x.shape, kernel, stride, pad)
    proj = rand(rng, *oshape, dtype=np.float64)
    out, dx = np.empty(oshape), np.empty_like(x)
    if kind == "max":
        state = ref.maxpool_forward(x, kernel, stride, pad, out)
        ref.maxpool_backward(proj, x, state, kernel, stride, pad, dx)

        def loss():
            ref.maxpool_forward(x, kernel, stride, pad, out)
            return float(np.sum(out * proj))
    else:
        ref.avgpool_backward(proj, kernel, stride, pad, dx)

        def loss():
            return float(np.sum(ref.avgpool_forward(x, kernel, stride, pad, out) * proj))
    fd_close(dx, numeric_grad(loss, x))


def test_reference_batchnorm_gradients_match_finite_differences():
    rng = np.random.default_rng(3)
    x = rand(rng, 3, 2, 3, 4, dtype=np.float64) * 2 + 0.5
    gamma, beta = rand(rng, 2, dtype=np.float64), rand(rng, 2, dtype=np.float64)
    proj = rand(rng, *x.shape, dtype=np.float64)
    eps = 1e-3
    out, mean, var = np.empty_like(x), np.empty(2), np.empty(2)

    def loss():
        return float(np.sum(ref.batchnorm_forward(x, gamma, beta, eps, out, mean, var) * proj))

    loss()
    dx, dgamma, dbeta = np.empty_like(x), np.empty(2), np.empty(2)
    ref.batchnorm_backward(proj, x, gamma, mean, var, eps, dx, dgamma, dbeta)
    fd_close(dx, numeric_grad(loss, x))
    fd_close(dgamma, numeric_grad(loss, gamma))
    fd_close(dbeta, numeric_grad(loss, beta))
    np.testing.assert_allclose(mean, x.mean(axis=(0, 2, 3)))
    np.testing.assert_allclose(var, x.var(axis=(0, 2, 3)))


def test_reference_dense_gradients_match_finite_differences():
    rng = np.random.default_rng(4)
    x, w, b = rand(rng, 4, 5, dtype=np.float64), rand(rng, 3, 5, dtype=np.float64), rand(rng, 3, dtype=np.float64)
    proj = rand(rng, 4, 3, dtype=np.float64)
    out = np.empty((4, 3))

    def loss():
        return float(np.sum(ref.dense_forward(x, w, b, out) * proj))

    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    ref.dense_backward_data(proj, w, dx)
    ref.dense_backward_weights(x, proj, dw, db)
    fd_close(dx, numeric_grad(loss, x))
    fd_close(dw, numeric_grad(loss, w))
    fd_close(db, numeric_grad(loss, b))


def test_reference_softmax_cross_entropy_value_and_gradient():
    rng = np.random.default_rng(5)
    logits = rand(rng, 6, 4, dtype=np.float64) * 3
    labels = rng.integers(0, 4, 6).astype(np.int64)
    d = np.empty_like(logits)
    loss = ref.softmax_cross_entropy(logits, labels, d)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert loss == pytest.approx(float(-np.mean(np.log(p[np.arange(6), labels]))), rel=1e-12)
    fd_close(d, numeric_grad(lambda: ref.softmax_cross_entropy(logits, labels, None), logits))


def test_reference_relu_add_concat_split_and_sgd():
    rng = np.random.default_rng(6)
    x, y = rand(rng, 2, 3, 4, 4), rand(rng, 2, 5, 4, 4)
    out = np.empty_like(x)
    np.testing.assert_array_equal(ref.relu_forward(x, out), np.where(x > 0, x, 0))
    dy = rand(rng, *x.shape)
    np.testing.assert_array_equal(ref.relu_backward(dy, x, np.empty_like(x)), np.where(x > 0, dy, 0))
    np.testing.assert_array_equal(ref.add(x, dy, np.empty_like(x)), x + dy)
    cat = ref.concat_channels([x, y], np.empty((2, 8, 4, 4), F32))
    np.testing.assert_array_equal(cat, np.concatenate([x, y], axis=1))
    a, b = ref.split_channels(cat, [3, 5], [np.empty_like(x), np.empty_like(y)])
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(b, y)
    p, g = x.copy(), dy.copy()
    ref.sgd_update(p, g, 0.5)
    np.testing.assert_allclose(p, x - F32(0.5) * dy)


def test_global_avgpool_is_avgpool_over_the_whole_plane(any_backend):
    x = rand(np.random.default_rng(7), 2, 3, 5, 6)
    out = np.empty((2, 3, 1, 1), F32)
    any_backend.avgpool_forward(x, (5, 6), 1, 0, out)
    close(out[:, :, 0, 0], x.mean(axis=(2, 3)))


# --- oneDNN against the reference (float32) -------------------------------------------------

@pytest.fixture(params=["blocked", "plain"])
def layouts(request, dnnl):
    """Run a oneDNN test with blocked internal layouts (default) and with plain ones."""
    dnnl.set_blocked_layouts(request.param == "blocked")
    yield request.param
    dnnl.set_blocked_layouts(True)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", CONV_CASES)
def test_onednn_convolution_matches_reference(dnnl, layouts, case, bias):
    rng = np.random.default_rng(10)
    x, w, b, stride, pad, oshape = conv_arrays(rng, case)
    b = b if bias else None
    assert dnnl.conv2d_output_shape(x.shape, w.shape, stride, pad) == oshape
    close(dnnl.conv2d_forward(x, w, b, stride, pad, np.empty(oshape, F32)),
          ref.conv2d_forward(x, w, b, stride, pad, np.empty(oshape, F32)))
    dy = rand(rng, *oshape)
    close(dnnl.conv2d_backward_data(dy, w, stride, pad, np.empty_like(x)),
          ref.conv2d_backward_data(dy, w, stride, pad, np.empty_like(x)))
    dw, dw_ref = np.empty_like(w), np.empty_like(w)
    db, db_ref = (np.empty(w.shape[0], F32), np.empty(w.shape[0], F32)) if bias else (None, None)
    dnnl.conv2d_backward_weights(x, dy, stride, pad, dw, db)
    ref.conv2d_backward_weights(x, dy, stride, pad, dw_ref, db_ref)
    close(dw, dw_ref)
    if bias:
        close(db, db_ref)


@pytest.mark.parametrize("case", POOL_CASES)
def test_onednn_pooling_matches_reference(dnnl, case):
    rng = np.random.default_rng(11)
    n, c, h, w, kernel, stride, pad = case
    x = rand(rng, n, c, h, w)
    oshape = _checks.pool_output_shape(x.shape, kernel, stride, pad)
    out, out_ref = np.empty(oshape, F32), np.empty(oshape, F32)
    state = dnnl.maxpool_forward(x, kernel, stride, pad, out)
    state_ref = ref.maxpool_forward(x, kernel, stride, pad, out_ref)
    close(out, out_ref)
    assert (state.shape, state.dtype) == dnnl.maxpool_state_spec(x.shape, oshape, kernel)
    dy = rand(rng, *oshape)
    close(dnnl.maxpool_backward(dy, x, state, kernel, stride, pad, np.empty_like(x)),
          ref.maxpool_backward(dy, x, state_ref, kernel, stride, pad, np.empty_like(x)))
    close(dnnl.avgpool_forward(x, kernel, stride, pad, out), ref.avgpool_forward(x, kernel, stride, pad, out_ref))
    close(dnnl.avgpool_backward(dy, kernel, stride, pad, np.empty_like(x)),
          ref.avgpool_backward(dy, kernel, stride, pad, np.empty_like(x)))


def test_onednn_maxpool_writes_into_a_caller_provided_state(dnnl):
    x = rand(np.random.default_rng(12), 2, 3, 8, 8)
    shape, dtype = dnnl.maxpool_state_spec(x.shape, (2, 3, 4, 4), 2)
    state = np.full(shape, 255, dtype=dtype)
    returned = dnnl.maxpool_forward(x, 2, 2, 0, np.empty(shape, F32), state=state)
    assert returned is state and state.max() < 4
    with pytest.raises(ValueError, match="maxpool_forward: state"):
        dnnl.maxpool_forward(x, 2, 2, 0, np.empty(shape, F32), state=np.empty(shape, np.int64))


@pytest.mark.parametrize("impl", ["numba", "onednn"])
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (8, 16, 7, 7), (3, 1, 1, 9), (2, 24, 5, 3)])
def test_onednn_batchnorm_matches_reference(dnnl, layouts, shape, impl):
    old = dnnl.set_numba_batchnorm(impl == "numba")
    try:
        _check_batchnorm(dnnl, shape)
    finally:
        dnnl.set_numba_batchnorm(old)


def test_onednn_sgd_update_is_bitwise_numpys(dnnl):
    """The threaded numba update equals NumPy's float32 ``param -= float32(lr) * grad`` bitwise."""
    rng = np.random.default_rng(21)
    for n in (1, 5, 4099, (1 << 16) - 1, 1 << 16, (1 << 18) - 1, 1 << 18, 300_001):
        for lr in (0.01, 0.1, 1 / 3, 2.5e-4):
            p = rng.standard_normal(n, dtype=F32) * F32(10)
            g = rng.standard_normal(n, dtype=F32) * F32(rng.uniform(0, 1e3))
            want = p.copy()
            want -= F32(lr) * g
            got = p.copy().reshape(-1, 1)
            assert dnnl.sgd_update(got, g.reshape(-1, 1), lr) is got
            assert np.array_equal(got.reshape(-1).view(np.int32), want.view(np.int32)), (n, lr)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("chunks", [1, 2, 3, 7, 64])
def test_sgd_parallel_chunks_cover_every_element_once(n, chunks):
    """Every element is updated exactly once, whatever the chunk count (chunks of 16-element
    multiples, the last ones short or empty)."""
    from cachedarrays.models.backend import _sgd
    if _sgd.numba is None:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(n + chunks)
    p, g = rng.standard_normal(n, dtype=F32), rng.standard_normal(n, dtype=F32)
    want = p.copy()
    want -= F32(0.25) * g
    g.flags.writeable = False                  # as sgd_update passes it
    _sgd._sgd_parallel(p, g, F32(0.25), chunks)
    assert np.array_equal(p.view(np.int32), want.view(np.int32))


def test_onednn_1x1_weight_reorders_are_two_dimensional(dnnl):
    """A 1x1 convolution's weights reorder as (K, C) matrices, not (K, C, 1, 1) tensors: oneDNN
    has a fast blocked transpose for the first and only generic code for the second."""
    from cachedarrays.models.backend import onednn
    rng = np.random.default_rng(3)
    dnnl.clear_cache()
    x, w, _, stride, pad, oshape = conv_arrays(rng, (2, 32, 2, 2, 48, 1, 1, 1, 0))   # blocked
    dy = rand(rng, *oshape)
    dnnl.conv2d_forward(x, w, None, stride, pad, np.empty(oshape, F32))
    dnnl.conv2d_backward_data(dy, w, stride, pad, np.empty_like(x))
    dnnl.conv2d_backward_weights(x, dy, stride, pad, np.empty_like(w), None)
    dims = [onednn._md_dims(r.md(onednn.api.ARG_FROM))
            for p in onednn._cache.values() for p in (p[0] if isinstance(p, tuple) else p,)
            for _, r in p.reorders.values()]
    assert [48, 32] in dims or [32, 48] in dims, dims
    assert not any(d[-2:] == [1, 1] for d in dims if len(d) == 4), dims


def test_onednn_channels_last_window_depends_on_the_cpu():
    """Channels-last convolutions start at 32x32 output pixels on other CPUs, and run from 8x8
    to 16x16 with 128 channels or more on AMD Zen, where the larger ones measured slower; the
    machine's default is its CPU's."""
    import llvmlite.binding as llvm

    from cachedarrays.models.backend import onednn
    assert onednn.nhwc_window("znver5") == onednn.nhwc_window("znver4") == (64, 256, 128)
    assert onednn.nhwc_window("sapphirerapids") == onednn.nhwc_window("skylake") == (1024, 0, 16)
    assert (onednn.NHWC_MIN_PIXELS, onednn.NHWC_MAX_PIXELS, onednn.NHWC_MIN_CHANNELS) == \
        onednn.nhwc_window(llvm.get_host_cpu_name())


def test_onednn_layout_rule_picks_plain_nhwc_and_blocked(dnnl, monkeypatch):
    """The fixed rule: plain for 1x1 kernels with >= 64 output pixels (>= 16 with at most 128
    output channels), channels-last for other kernels with >= 32x32 output pixels and >= 16
    input and output channels (the window of a Xeon), else blocked; on AMD Zen's window,
    channels-last from 8x8 to 16x16 output pixels with >= 128 channels; each of the three
    gives the reference's result."""
    from cachedarrays.models.backend import onednn
    for name, value in zip(("NHWC_MIN_PIXELS", "NHWC_MAX_PIXELS", "NHWC_MIN_CHANNELS"),
                           onednn.nhwc_window("sapphirerapids")):
        monkeypatch.setattr(onednn, name, value)
    rule = onednn._rule_layout
    assert rule((16, 64, 16, 16), (64, 64, 1, 1), (1, 1)) == "plain"
    assert rule((16, 64, 8, 8), (1024, 64, 1, 1), (1, 1)) == "plain"       # 64 pixels
    assert rule((16, 512, 4, 4), (128, 512, 1, 1), (1, 1)) == "plain"      # 16 pixels, K 128
    assert rule((16, 512, 8, 8), (128, 512, 1, 1), (2, 2)) == "plain"      # 4x4 output
    assert rule((16, 512, 4, 4), (129, 512, 1, 1), (1, 1)) == "blocked"    # K 129
    assert rule((16, 1024, 4, 4), (256, 1024, 1, 1), (1, 1)) == "blocked"
    assert rule((16, 512, 2, 2), (128, 512, 1, 1), (1, 1)) == "blocked"    # 4 pixels
    assert rule((16, 512, 4, 3), (128, 512, 1, 1), (1, 1)) == "blocked"    # 12 pixels
    assert rule((16, 64, 64, 64), (64, 64, 3, 3), (1, 1)) == "nhwc"
    assert rule((16, 64, 64, 64), (64, 64, 3, 3), (2, 2)) == "nhwc"        # 32x32 output
    assert rule((16, 64, 62, 62), (64, 64, 3, 3), (2, 2)) == "blocked"     # 31x31
    assert rule((16, 3, 64, 64), (64, 3, 3, 3), (1, 1)) == "blocked"       # 3 channels
    assert rule((16, 512, 4, 4), (512, 512, 3, 3), (1, 1)) == "blocked"
    assert rule((16, 64, 64, 64), (8, 64, 3, 3), (1, 1)) == "blocked"      # 8 output channels
    for name, value in zip(("NHWC_MIN_PIXELS", "NHWC_MAX_PIXELS", "NHWC_MIN_CHANNELS"),
                           onednn.nhwc_window("znver5")):
        monkeypatch.setattr(onednn, name, value)
    assert rule((16, 64, 64, 64), (64, 64, 3, 3), (1, 1)) == "blocked"     # 64x64
    assert rule((16, 128, 32, 32), (128, 128, 3, 3), (1, 1)) == "blocked"  # 32x32
    assert rule((16, 128, 16, 16), (256, 128, 3, 3), (1, 1)) == "nhwc"     # 16x16
    assert rule((16, 512, 8, 8), (512, 512, 3, 3), (1, 1)) == "nhwc"       # 8x8
    assert rule((16, 256, 16, 16), (256, 256, 3, 3), (2, 2)) == "nhwc"     # 8x8 output
    assert rule((16, 512, 4, 4), (512, 512, 3, 3), (1, 1)) == "blocked"    # 4x4
    assert rule((16, 64, 16, 16), (64, 64, 3, 3), (1, 1)) == "blocked"     # 64 channels
    assert rule((16, 128, 16, 16), (32, 128, 3, 3), (1, 1)) == "blocked"   # 32 outputs
    assert rule((16, 256, 16, 16), (256, 256, 1, 1), (1, 1)) == "plain"    # 1x1: as before
    monkeypatch.setattr(onednn, "NHWC_MIN_PIXELS", 0)                     # off
    assert rule((16, 128, 16, 16), (256, 128, 3, 3), (1, 1)) == "blocked"
    rng = np.random.default_rng(5)
    x, w, b, stride, pad, oshape = conv_arrays(rng, (1, 16, 32, 32, 16, 3, 3, 1, 1))
    dy = rand(rng, *oshape)
    for layout in onednn.LAYOUTS:
        old = onednn._rule_layout
        onednn._rule_layout = lambda *a, _l=layout: _l
        try:
            close(dnnl.conv2d_forward(x, w, b, stride, pad, np.empty(oshape, F32)),
                  ref.conv2d_forward(x, w, b, stride, pad, np.empty(oshape, F32)))
            close(dnnl.conv2d_backward_data(dy, w, stride, pad, np.empty_like(x)),
                  ref.conv2d_backward_data(dy, w, stride, pad, np.empty_like(x)))
            dw, dw_ref = np.empty_like(w), np.empty_like(w)
            dnnl.conv2d_backward_weights(x, dy, stride, pad, dw, None)
            ref.conv2d_backward_weights(x, dy, stride, pad, dw_ref, None)
            close(dw, dw_ref)
        finally:
            onednn._rule_layout = old
        assert any(k[0] == "conv_fwd" and k[-1] == layout for k in onednn._cache), layout


@pytest.fixture
def two_threads(dnnl):
    """oneDNN on two OpenMP threads for the test, the caller's count back after it."""
    old = dnnl.get_threads()
    dnnl.set_threads(2)
    try:
        yield
    finally:
        dnnl.set_threads(old)


def _execution_threads(monkeypatch):
    """The OpenMP thread count of every primitive executed from now on, in a list."""
    from cachedarrays.models.backend import onednn
    seen = []
    real = onednn._primitive_execute

    def spy(*args):
        seen.append(onednn.get_threads())
        return real(*args)

    monkeypatch.setattr(onednn, "_primitive_execute", spy)
    return seen


def test_onednn_small_primitives_run_on_one_thread_and_restore_the_count(dnnl, monkeypatch,
                                                                          two_threads):
    """Small reorders and convolutions run on one OpenMP thread (SERIAL_BYTES, SERIAL_FLOPS);
    the caller's thread count is back afterwards, also after an exception, and the results
    match the reference with the rule on and off."""
    from cachedarrays.models.backend import onednn
    seen = _execution_threads(monkeypatch)
    rng = np.random.default_rng(8)
    case = (2, 16, 6, 6, 16, 3, 3, 1, 1)       # 2 * 2*36*16*16*9 flops: one thread
    x, w, b, stride, pad, oshape = conv_arrays(rng, case)
    want = ref.conv2d_forward(x, w, b, stride, pad, np.empty(oshape, F32))
    close(dnnl.conv2d_forward(x, w, b, stride, pad, np.empty(oshape, F32)), want)
    assert seen and set(seen) == {1} and dnnl.get_threads() == 2
    seen.clear()
    monkeypatch.setattr(onednn, "SERIAL_FLOPS", 0)
    monkeypatch.setattr(onednn, "SERIAL_BYTES", 0)
    close(dnnl.conv2d_forward(x, w, b, stride, pad, np.empty(oshape, F32)), want)
    assert seen and set(seen) == {2}
    with pytest.raises(RuntimeError, match="inside"):
        with onednn._OneThread():
            assert dnnl.get_threads() == 1
            raise RuntimeError("inside")
    assert dnnl.get_threads() == 2


def test_onednn_small_dense_layers_run_on_one_thread(dnnl, monkeypatch, two_threads):
    """A dense layer of at most SERIAL_FLOPS of arithmetic (forward and both gradients) runs on
    one OpenMP thread, a larger one on the caller's count; results match the reference."""
    from cachedarrays.models.backend import onednn
    monkeypatch.setattr(onednn, "SERIAL_BYTES", 0)     # the dense rule alone
    monkeypatch.setattr(onednn, "_dense_impl", "onednn")
    seen = _execution_threads(monkeypatch)
    rng = np.random.default_rng(3)
    for n, threads in ((4, 1), (onednn.SERIAL_FLOPS // (2 * 64 * 48) + 1, 2)):
        x = rng.standard_normal((n, 64), dtype=F32)
        w = rng.standard_normal((48, 64), dtype=F32)
        b = rng.standard_normal(48, dtype=F32)
        dy = rng.standard_normal((n, 48), dtype=F32)
        seen.clear()
        out = dnnl.dense_forward(x, w, b, np.empty((n, 48), F32))
        close(out, ref.dense_forward(x, w, b, np.empty((n, 48), F32)))
        dx = dnnl.dense_backward_data(dy, w, np.empty((n, 64), F32))
        close(dx, ref.dense_backward_data(dy, w, np.empty((n, 64), F32)))
        dw, db = np.empty((48, 64), F32), np.empty(48, F32)
        dnnl.dense_backward_weights(x, dy, dw, db)
        dw_ref, db_ref = np.empty((48, 64), F32), np.empty(48, F32)
        ref.dense_backward_weights(x, dy, dw_ref, db_ref)
        close(dw, dw_ref)
        close(db, db_ref)
        assert seen and set(seen) == {threads}, (n, seen)
    assert dnnl.get_threads() == 2


@pytest.mark.parametrize("shape", [(3, 130, 2, 2), (16, 64, 4, 4), (2, 65, 3, 1), (1, 1, 1, 1),
                                   (4, 200, 5, 6)])
def test_batchnorm_small_plane_kernels_agree_with_the_per_channel_ones(monkeypatch, shape):
    """The small-plane kernels (channel blocks crossed, a channel slice of a larger array for
    x, relu, the mask and acc) give the per-channel kernels' results to float32 rounding."""
    from cachedarrays.models.backend import _bnorm
    rng = np.random.default_rng(sum(shape))
    n, c, h, w = shape
    x = rng.standard_normal((n, c + 7, h, w), dtype=F32)[:, 4:4 + c]
    dy, g, b = rand(rng, *shape), rand(rng, c), rand(rng, c)
    acc = rand(rng, n, c + 3, h, w)
    results = []
    for plane in (0, 64):                  # every plane per channel, then in channel blocks
        monkeypatch.setattr(_bnorm, "SMALL_PLANE", plane)
        out = []
        for relu in (False, True):
            y, mean, var = np.empty(shape, F32), np.empty(c, F32), np.empty(c, F32)
            _bnorm.forward(x, g, b, 1e-5, y, mean, var, relu=relu)
            out += [y, mean, var]
        for kw in ({}, {"y": y}, {"y": y, "acc": acc}):
            dx, dg, db = np.empty(shape, F32), np.empty(c, F32), np.empty(c, F32)
            _bnorm.backward(dy, x, g, mean, var, 1e-5, dx, dg, db, **kw)
            out += [dx, dg, db]
        results.append(out)
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def _check_batchnorm(dnnl, shape):
    rng = np.random.default_rng(13)
    x = rand(rng, *shape) * 2 + 1
    c = shape[1]
    gamma, beta, eps = rand(rng, c), rand(rng, c), 1e-5
    res = {}
    for name, be in (("dnnl", dnnl), ("ref", ref)):
        out, mean, var = np.empty_like(x), np.empty(c, F32), np.empty(c, F32)
        be.batchnorm_forward(x, gamma, beta, eps, out, mean, var)
        res[name] = [out, mean, var]
    for a, b in zip(res["dnnl"], res["ref"]):
        close(a, b)
    mean, var = res["ref"][1], res["ref"][2]
    dy = rand(rng, *shape)
    grads = {}
    for name, be in (("dnnl", dnnl), ("ref", ref)):
        dx, dgamma, dbeta = np.empty_like(x), np.empty(c, F32), np.empty(c, F32)
        be.batchnorm_backward(dy, x, gamma, mean, var, eps, dx, dgamma, dbeta)
        grads[name] = [dx, dgamma, dbeta]
    for a, b in zip(grads["dnnl"], grads["ref"]):
        close(a, b)
    close(dnnl.batchnorm_inference(x, gamma, beta, mean, var, eps, np.empty_like(x)),
          ref.batchnorm_inference(x, gamma, beta, mean, var, eps, np.empty_like(x)))


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (17,), (4, 33)])
def test_onednn_elementwise_ops_match_reference(dnnl, shape):
    rng = np.random.default_rng(14)
    x, dy = rand(rng, *shape), rand(rng, *shape)
    np.testing.assert_array_equal(dnnl.relu_forward(x, np.empty_like(x)), ref.relu_forward(x, np.empty_like(x)))
    np.testing.assert_array_equal(dnnl.relu_backward(dy, x, np.empty_like(x)),
                                  ref.relu_backward(dy, x, np.empty_like(x)))
    np.testing.assert_array_equal(dnnl.add(x, dy, np.empty_like(x)), x + dy)
    inplace = x.copy()
    assert dnnl.relu_forward(inplace, inplace) is inplace
    np.testing.assert_array_equal(inplace, np.maximum(x, 0))
    acc = x.copy()
    dnnl.add(acc, dy, acc)
    np.testing.assert_array_equal(acc, x + dy)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n, i, o", [(5, 7, 3), (1, 64, 10), (16, 33, 17)])
def test_onednn_dense_matches_reference(dnnl, n, i, o, bias):
    rng = np.random.default_rng(15)
    x, w, b, dy = rand(rng, n, i), rand(rng, o, i), rand(rng, o) if bias else None, rand(rng, n, o)
    close(dnnl.dense_forward(x, w, b, np.empty((n, o), F32)), ref.dense_forward(x, w, b, np.empty((n, o), F32)))
    close(dnnl.dense_backward_data(dy, w, np.empty_like(x)), ref.dense_backward_data(dy, w, np.empty_like(x)))
    dw, dw_ref = np.empty_like(w), np.empty_like(w)
    db, db_ref = (np.empty(o, F32), np.empty(o, F32)) if bias else (None, None)
    dnnl.dense_backward_weights(x, dy, dw, db)
    ref.dense_backward_weights(x, dy, dw_ref, db_ref)
    close(dw, dw_ref)
    if bias:
        close(db, db_ref)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("n, i, o", [(5, 7, 3), (1100, 13, 64), (300, 5, 300), (257, 64, 1), (0, 4, 3), (3, 0, 2),
                                     (4, 3, 0)])
def test_onednn_dense_relu_and_bias_gradient_match_reference(dnnl, n, i, o, relu):
    """The fused forward (ReLU as a post-op), the weight gradient as a matmul with the bias
    gradient beside it, and the fused ReLU backward + bias gradient, in place and not, at
    shapes that span several row chunks and at empty ones."""
    rng = np.random.default_rng(19)
    x, w, b, dy = rand(rng, n, i), rand(rng, o, i), rand(rng, o), rand(rng, n, o)
    y, y_ref = np.full((n, o), np.nan, F32), np.full((n, o), np.nan, F32)
    dnnl.dense_forward(x, w, b, y, relu=relu)
    ref.dense_forward(x, w, b, y_ref, relu=relu)
    close(y, y_ref)
    if relu:
        assert (y >= 0).all()
    dw, db = np.full((o, i), np.nan, F32), np.full(o, np.nan, F32)
    dw_ref, db_ref = np.empty_like(dw), np.empty_like(db)
    dnnl.dense_backward_weights(x, dy, dw, db)
    ref.dense_backward_weights(x, dy, dw_ref, db_ref)
    close(dw, dw_ref)
    close(db, db_ref)
    dx_ref, db_ref = np.empty_like(dy), np.empty(o, F32)
    ref.relu_backward_bias(dy, y_ref, dx_ref, db_ref)
    np.testing.assert_array_equal(dx_ref, dy * (y_ref > 0))
    dx = np.full_like(dy, np.nan)
    assert dnnl.relu_backward_bias(dy, y_ref, dx, db) is dx
    np.testing.assert_array_equal(dx, dx_ref)
    close(db, db_ref)
    inplace = dy.copy()
    db[:] = np.nan
    assert dnnl.relu_backward_bias(inplace, y_ref, inplace, db) is inplace
    np.testing.assert_array_equal(inplace, dx_ref)
    close(db, db_ref)


@pytest.mark.parametrize("relu", [True, False])
def test_onednn_dense_falls_back_to_the_inner_product_where_matmul_is_reference_code(
        dnnl, monkeypatch, relu):
    """Where oneDNN offers only reference code for the transposed-operand matmul (another CPU),
    the forward and the weight gradient run its inner product instead, with the same results."""
    rng = np.random.default_rng(22)
    x, w, b, dy = rand(rng, 40, 9), rand(rng, 6, 9), rand(rng, 6), rand(rng, 40, 6)
    dnnl.clear_cache()
    monkeypatch.setattr(dnnl, "_optimized", lambda pd: False)
    try:
        y, y_ref = np.empty((40, 6), F32), np.empty((40, 6), F32)
        dnnl.dense_forward(x, w, b, y, relu=relu)
        ref.dense_forward(x, w, b, y_ref, relu=relu)
        close(y, y_ref)
        assert dnnl._mm_fwd(x.shape, w.shape, True, relu)[1] is False
        dw, db, dw_ref, db_ref = np.empty_like(w), np.empty(6, F32), np.empty_like(w), np.empty(6, F32)
        dnnl.dense_backward_weights(x, dy, dw, db)
        ref.dense_backward_weights(x, dy, dw_ref, db_ref)
        close(dw, dw_ref)
        close(db, db_ref)
    finally:
        dnnl.clear_cache()


@pytest.mark.parametrize("optimized", [True, False])
def test_onednn_weight_gradient_computed_as_its_transpose_matches_reference(dnnl, monkeypatch,
                                                                           optimized):
    """At the shapes ``_wgrad_transposed`` names, dw comes from dw.T = x.T @ dy in a scratch
    buffer (or, where oneDNN offers only reference code for that, from the direct product),
    with the same results; threads sharing the shape's scratch buffer do not mix results."""
    monkeypatch.setattr(dnnl, "WGRAD_TRANSPOSED_MIN_BATCH", 64)
    n, i, o = 300, 64, 96
    assert dnnl._wgrad_transposed(n, i, o) and not dnnl._wgrad_transposed(n, o, i)
    assert not dnnl._wgrad_transposed(n, i, o + 1) and not dnnl._wgrad_transposed(63, i, o)
    dnnl.clear_cache()
    if not optimized:           # another CPU: reference code only, for every matmul
        monkeypatch.setattr(dnnl, "_optimized", lambda pd: False)
    try:
        rng = np.random.default_rng(31)
        cases = [(rand(rng, n, i), rand(rng, n, o)) for _ in range(4)]
        expect = []
        for x, dy in cases:
            dw_ref, db_ref = np.empty((o, i), F32), np.empty(o, F32)
            ref.dense_backward_weights(x, dy, dw_ref, db_ref)
            expect.append((dw_ref, db_ref))
        dw, db = np.full((o, i), np.nan, F32), np.full(o, np.nan, F32)
        assert dnnl.dense_backward_weights(*cases[0], dw, db) is dw
        close(dw, expect[0][0])
        close(db, expect[0][1])
        dw[:] = np.nan
        dnnl.dense_backward_weights(*cases[0], dw, None)
        close(dw, expect[0][0])
        assert (dnnl._wgrad_transposed_primitive(n, i, o) is not None) == optimized
        errors = []

        def work(k):
            out = np.empty((o, i), F32)
            for _ in range(20):
                dnnl.dense_backward_weights(*cases[k], out, None)
                if not np.allclose(out, expect[k][0], rtol=1e-4, atol=1e-4):
                    errors.append(k)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
    finally:
        dnnl.clear_cache()


def test_relu_backward_bias_refuses_bad_arguments(dnnl):
    rng = np.random.default_rng(20)
    dy, y = rand(rng, 8, 4), rand(rng, 8, 4)
    for be in (dnnl, ref):
        with pytest.raises(ValueError, match="relu_backward_bias.*db"):
            be.relu_backward_bias(dy, y, np.empty_like(dy), np.empty(3, F32))
        with pytest.raises(ValueError, match="relu_backward_bias"):
            be.relu_backward_bias(dy, rand(rng, 8, 5), np.empty_like(dy), np.empty(4, F32))



@pytest.mark.parametrize("rows", [8, 40000])      # NumPy's passes and the threaded kernel
def test_relu_backward_bias_with_dx_partly_overlapping_dy(dnnl, rows):
    rng = np.random.default_rng(21)
    buf, y = rand(rng, rows + 1, 4), rand(rng, rows, 4)
    dy = buf[:rows].copy()
    dx_ref, db_ref = np.empty_like(dy), np.empty(4, F32)
    ref.relu_backward_bias(dy, y, dx_ref, db_ref)
    db = np.empty(4, F32)
    dnnl.relu_backward_bias(buf[:rows], y, buf[1:], db)
    np.testing.assert_array_equal(buf[1:], dx_ref)
    close(db, db_ref)


def test_onednn_plumbing_loss_and_update_match_reference(dnnl):
    rng = np.random.default_rng(16)
    xs = [rand(rng, 2, c, 3, 3) for c in (2, 4, 1)]
    cat = dnnl.concat_channels(xs, np.empty((2, 7, 3, 3), F32))
    np.testing.assert_array_equal(cat, np.concatenate(xs, axis=1))
    parts = dnnl.split_channels(cat, [2, 4, 1], [np.empty_like(a) for a in xs])
    for a, b in zip(parts, xs):
        np.testing.assert_array_equal(a, b)
    logits, labels = rand(rng, 8, 10), rng.integers(0, 10, 8).astype(np.int64)
    d, d_ref = np.empty_like(logits), np.empty_like(logits)
    assert dnnl.softmax_cross_entropy(logits, labels, d) == pytest.approx(ref.softmax_cross_entropy(logits, labels, d_ref))
    close(d, d_ref)
    p, g = rand(rng, 3, 4), rand(rng, 3, 4)
    expected = p - F32(0.1) * g
    dnnl.sgd_update(p, g, 0.1)
    close(p, expected)


# --- oneDNN buffer binding, caching and threads ---------------------------------------------

def test_onednn_rebinds_buffers_on_every_call(dnnl, layouts):
    """A cached primitive follows the arrays it is given, even read-only views of new buffers."""
    rng = np.random.default_rng(17)
    x, w, b, stride, pad, oshape = conv_arrays(rng, CONV_CASES[0])
    first = dnnl.conv2d_forward(x, w, b, stride, pad, np.empty(oshape, F32)).copy()
    cached = dnnl.cache_size()
    x2 = rand(rng, *x.shape)
    x2.flags.writeable = False
    out2 = np.empty(oshape, F32)
    dnnl.conv2d_forward(x2, w, b, stride, pad, out2)
    assert dnnl.cache_size() == cached
    close(out2, ref.conv2d_forward(x2, w, b, stride, pad, np.empty(oshape, F32)))
    close(dnnl.conv2d_forward(x, w, b, stride, pad, np.empty(oshape, F32)), first)


def test_onednn_concurrent_calls_give_correct_results(dnnl, layouts):
    rng = np.random.default_rng(18)
    x, w, b, stride, pad, oshape = conv_arrays(rng, CONV_CASES[5])
    inputs = [rand(rng, *x.shape) for _ in range(4)]
    expected = [ref.conv2d_forward(a, w, b, stride, pad, np.empty(oshape, F32)) for a in inputs]
    results = [np.empty(oshape, F32) for _ in inputs]

    def work(i):
        for _ in range(5):
            dnnl.conv2d_forward(inputs[i], w, b, stride, pad, results[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, e in zip(results, expected):
        close(r, e)


def test_onednn_blocked_layouts_use_library_buffers_that_clear_cache_releases(dnnl):
    rng = np.random.default_rng(19)
    x, w, b, stride, pad, oshape = conv_arrays(rng, CONV_CASES[5])
    dnnl.clear_cache()
    assert dnnl.cache_size() == 0 and dnnl.buffer_bytes() == 0
    dnnl.conv2d_forward(x, w, b, stride, pad, np.empty(oshape, F32))
    assert dnnl.cache_size() >= 1
    assert all(isinstance(name, str) and name for name in dnnl.impl_info().values())
    from cachedarrays.models.backend import onednn
    held = [weakref.ref(onednn._arena), weakref.ref(onednn._scratch)]
    dnnl.clear_cache()
    assert dnnl.buffer_bytes() == 0
    assert [r() for r in held] == [None, None]      # nothing (a cached pointer) keeps them


def test_onednn_impl_info_names_every_kind_of_cached_primitive(dnnl):
    # dense kernels cache (primitive, flag) pairs; impl_info must name those too
    rng = np.random.default_rng(23)
    x, w = rng.standard_normal((64, 24), dtype=F32), rng.standard_normal((8, 24), dtype=F32)
    b, dy = rng.standard_normal(8, dtype=F32), rng.standard_normal((64, 8), dtype=F32)
    dnnl.clear_cache()
    dnnl.dense_forward(x, w, b, np.empty((64, 8), F32), relu=True)
    dnnl.dense_backward_weights(x, dy, np.empty((8, 24), F32), np.empty(8, F32))
    dnnl.dense_backward_data(dy, w, np.empty((64, 24), F32))
    dnnl.relu_forward(dy, np.empty_like(dy))
    info = dnnl.impl_info()
    assert {key[0] for key in info} >= {"mm_fwd", "mm_bwd_weights", "ip_bwd_data"}
    assert all(isinstance(name, str) and name and name != "?" for name in info.values())
    dnnl.clear_cache()


def test_onednn_thread_count_can_be_set(dnnl):
    before = dnnl.get_threads()
    try:
        dnnl.set_threads(1)
        assert dnnl.get_threads() == 1
    finally:
        dnnl.set_threads(before)
    with pytest.raises(ValueError, match="set_threads"):
        dnnl.set_threads(0)


def test_onednn_failed_call_raises_with_function_and_status_name(dnnl):
    md = _dnnl_api.ffi.new("dnnl_memory_desc_t *")
    dims = _dnnl_api.ffi.new("dnnl_dims_t", [1] * 12)
    with pytest.raises(_dnnl_api.OneDNNError, match="dnnl_memory_desc_create_with_tag failed with dnnl_invalid_arguments"):
        _dnnl_api.check(dnnl._lib, "dnnl_memory_desc_create_with_tag", md, 13, dims, _dnnl_api.DT_F32, _dnnl_api.TAG_ABCD)


def test_missing_library_error_names_packages_and_paths(monkeypatch, tmp_path):
    monkeypatch.setattr(_dnnl_api.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(_dnnl_api.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(ImportError) as info:
        _dnnl_api.load_library()
    assert isinstance(info.value, _dnnl_api.OneDNNNotFoundError)
    message = str(info.value)
    assert "onednn-cpu-gomp" in message and "onednn-devel-cpu-gomp" in message
    assert str(tmp_path / "lib" / "libdnnl.so.3") in message


# --- argument validation ----------------------------------------------------------------------

def test_shape_errors_name_the_operation(any_backend):
    be = any_backend
    x, w = np.zeros((2, 3, 8, 8), F32), np.zeros((4, 3, 3, 3), F32)
    with pytest.raises(ValueError, match=r"conv2d_forward: out has shape \(2, 4, 7, 7\), expected \(2, 4, 8, 8\)"):
        be.conv2d_forward(x, w, None, 1, 1, np.zeros((2, 4, 7, 7), F32))
    with pytest.raises(ValueError, match="conv2d_forward: channel mismatch"):
        be.conv2d_forward(x, np.zeros((4, 2, 3, 3), F32), None, 1, 1, np.zeros((2, 4, 8, 8), F32))
    with pytest.raises(ValueError, match="conv2d_backward_data: dy has shape"):
        be.conv2d_backward_data(np.zeros((2, 4, 5, 5), F32), w, 1, 1, np.zeros_like(x))
    with pytest.raises(ValueError, match="conv2d_backward_weights: db has shape"):
        be.conv2d_backward_weights(x, np.zeros((2, 4, 8, 8), F32), 1, 1, np.zeros_like(w), np.zeros(3, F32))
    with pytest.raises(ValueError, match="maxpool_forward: pad"):
        be.maxpool_forward(x, 2, 2, 2, np.zeros((2, 3, 6, 6), F32))
    with pytest.raises(ValueError, match="avgpool_backward: dy has shape"):
        be.avgpool_backward(np.zeros((2, 3, 3, 3), F32), 2, 2, 0, np.zeros_like(x))
    with pytest.raises(ValueError, match="batchnorm_forward: gamma has shape"):
        be.batchnorm_forward(x, np.ones(4, F32), np.zeros(3, F32), 1e-5, np.zeros_like(x),
                             np.zeros(3, F32), np.zeros(3, F32))
    with pytest.raises(ValueError, match="relu_backward: dx has shape"):
        be.relu_backward(x, x, np.zeros((2, 3, 8, 7), F32))
    with pytest.raises(ValueError, match=r"dense_forward: x \(4, 5\) has 5 features but w \(3, 6\)"):
        be.dense_forward(np.zeros((4, 5), F32), np.zeros((3, 6), F32), None, np.zeros((4, 3), F32))
    with pytest.raises(ValueError, match="concat_channels: channels of"):
        be.concat_channels([x, x], np.zeros((2, 5, 8, 8), F32))
    with pytest.raises(ValueError, match="split_channels: sizes"):
        be.split_channels(x, [1, 1], [np.zeros((2, 1, 8, 8), F32)] * 2)
    with pytest.raises(ValueError, match=r"softmax_cross_entropy: labels must lie in \[0, 3\)"):
        be.softmax_cross_entropy(np.zeros((2, 3), F32), np.array([0, 3]), None)
    with pytest.raises(ValueError, match="add: b has shape"):
        be.add(x, np.zeros((2, 3, 8, 1), F32), np.zeros_like(x))
    with pytest.raises(ValueError, match="conv2d_forward: x has dtype int32"):
        be.conv2d_forward(x.astype(np.int32), w, None, 1, 1, np.zeros((2, 4, 8, 8), F32))
    with pytest.raises(ValueError, match="relu_forward: output out .* is read-only"):
        ro = np.zeros_like(x)
        ro.flags.writeable = False
        be.relu_forward(x, ro)


def test_onednn_rejects_layouts_it_cannot_bind(dnnl):
    x = np.zeros((2, 3, 8, 8), F32)
    with pytest.raises(ValueError, match=r"relu_forward: x .* must be C-contiguous"):
        dnnl.relu_forward(x.transpose(0, 1, 3, 2), np.zeros_like(x))
    with pytest.raises(ValueError, match="relu_forward: x has dtype float64, expected float32"):
        dnnl.relu_forward(x.astype(np.float64), np.zeros_like(x))


def _frozen(*arrays):
    """Read-only copies of arrays."""
    out = []
    for a in arrays:
        a = a.copy()
        a.flags.writeable = False
        out.append(a)
    return out


def _signatures(*kernels):
    return [tuple(k.signatures) for k in kernels]


@pytest.mark.parametrize("shape", [(4, 6, 2, 2), (2, 3, 9, 9)])
def test_batchnorm_kernels_compile_once_whatever_the_inputs_flags(shape):
    """Read-only and writable inputs (a parameter, a read-scope view, a fresh gradient) reach
    the batch-norm kernels as one numba type: a second call with other flags compiles nothing
    (each specialisation takes seconds to compile)."""
    from cachedarrays.models.backend import _bnorm
    kernels = (_bnorm._forward, _bnorm._forward_small, _bnorm._backward,
               _bnorm._backward_masked, _bnorm._backward_small)
    rng = np.random.default_rng(5)
    n, c, h, w = shape
    inputs = [rand(rng, *shape), rand(rng, c), rand(rng, c), rand(rng, *shape),
              rand(rng, *shape), rand(rng, *shape)]

    def run(x, g, b, dy, y_in, acc):
        for relu in (False, True):
            y, mean, var = np.empty(shape, F32), np.empty(c, F32), np.empty(c, F32)
            _bnorm.forward(x, g, b, 1e-5, y, mean, var, relu=relu)
        if not y_in.flags.writeable:
            mean, var, y = _frozen(mean, var, y)
        for kw in ({}, {"y": y}, {"y": y, "acc": acc}):
            dx, dg, db = np.empty(shape, F32), np.empty(c, F32), np.empty(c, F32)
            _bnorm.backward(dy, x, g, mean, var, 1e-5, dx, dg, db, **kw)
        return dx

    first = run(*inputs)
    compiled = _signatures(*kernels)
    assert np.array_equal(run(*_frozen(*inputs)), first)
    assert _signatures(*kernels) == compiled
