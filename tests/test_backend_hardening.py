"""Bad arguments to the compute backends and the CNN layers: a ValueError naming the operation
or layer, the same on both backends, and oneDNN agreeing with the NumPy reference on the
shapes both accept."""

import numpy as np
import pytest

import cachedarrays as ca
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cachedarrays.models import backend as backends
from cachedarrays.models import cnn
from cachedarrays.models.cnn import layers as L

F32 = np.float32
BACKENDS = backends.available_backends()
ref = backends.get_backend("numpy")


def z(*shape):
    return np.zeros(shape, F32)


@pytest.fixture(params=BACKENDS)
def be(request):
    return backends.get_backend(request.param)


# --- layers ---------------------------------------------------------------------------------

S = (2, 3, 8, 8)
BAD_LAYERS = {
    "conv out_channels 0": lambda: L.Conv2d("c", S, 0, 3),
    "conv out_channels -1": lambda: L.Conv2d("c", S, -1, 3),
    "conv out_channels 2.5": lambda: L.Conv2d("c", S, 2.5, 3),
    "conv out_channels True": lambda: L.Conv2d("c", S, True, 3),
    "conv out_channels '4'": lambda: L.Conv2d("c", S, "4", 3),
    "conv kernel 0": lambda: L.Conv2d("c", S, 4, 0),
    "conv kernel 2.7": lambda: L.Conv2d("c", S, 4, 2.7),
    "conv kernel (3,)": lambda: L.Conv2d("c", S, 4, (3,)),
    "conv kernel (3, 3, 3)": lambda: L.Conv2d("c", S, 4, (3, 3, 3)),
    "conv stride 0": lambda: L.Conv2d("c", S, 4, 3, stride=0),
    "conv stride -1": lambda: L.Conv2d("c", S, 4, 3, stride=-1),
    "conv stride 2**40": lambda: L.Conv2d("c", S, 4, 3, stride=2 ** 40),
    "conv pad -1": lambda: L.Conv2d("c", S, 4, 3, pad=-1),
    "conv batch 0": lambda: L.Conv2d("c", (0, 3, 8, 8), 4, 3),
    "conv channels 0": lambda: L.Conv2d("c", (2, 0, 8, 8), 4, 3),
    "conv channels 3.5": lambda: L.Conv2d("c", (2, 3.5, 8, 8), 4, 3),
    "batchnorm channels -3": lambda: L.BatchNorm2d("c", (2, -3, 4, 4)),
    "batchnorm batch 0": lambda: L.BatchNorm2d("c", (0, 3, 4, 4)),
    "relu a string shape": lambda: L.ReLU("c", "abc"),
    "relu size -3": lambda: L.ReLU("c", (2, -3)),
    "maxpool kernel 0": lambda: L.MaxPool2d("c", S, 0),
    "maxpool kernel -1": lambda: L.MaxPool2d("c", S, -1),
    "maxpool stride 0": lambda: L.MaxPool2d("c", S, 2, stride=0),
    "maxpool pad = kernel": lambda: L.MaxPool2d("c", S, 2, pad=2),
    "maxpool pad -1": lambda: L.MaxPool2d("c", S, 2, pad=-1),
    "avgpool kernel 0": lambda: L.AvgPool2d("c", S, 0),
    "avgpool pad > kernel": lambda: L.AvgPool2d("c", S, 2, pad=3),
    "avgpool global of a 2-d input": lambda: L.AvgPool2d("c", (2, 3)),
    "dense out_features 0": lambda: L.Dense("c", (2, 5), 0),
    "dense out_features 2.5": lambda: L.Dense("c", (2, 5), 2.5),
    "dense features 0": lambda: L.Dense("c", (2, 0), 3),
    "dense batch -2": lambda: L.Dense("c", (-2, 5), 3),
    "flatten a 1-d input": lambda: L.Flatten("c", (2,)),
}


@pytest.mark.parametrize("case", BAD_LAYERS)
def test_layers_refuse_sizes_and_geometry_that_are_not_whole_positive_numbers(case):
    with pytest.raises(ValueError, match="layer c: "):
        BAD_LAYERS[case]()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_run_before_init_names_the_layer_and_the_fix(backend):
    """(Built from sizes of any integer type, and whole floats, which stay accepted.)"""
    conv = L.Conv2d("fc", (np.int64(2), 3, 8.0, 8), np.int32(4), (3, np.int64(3)), stride=2, pad=1)
    assert conv.out_shape == (2, 4, 4, 4) and conv.w_shape == (4, 3, 3, 3)
    assert L.AvgPool2d("p", (2, 3, 5, 7)).out_shape == (2, 3, 1, 1)
    dense = L.Dense("fc", (2, 5), 3.0)
    assert dense.w_shape == (3, 5)
    m, s = cnn.make_session("LM", fast="1MiB", slow="16MiB", backend=backend)
    try:
        for layer in (dense, conv, L.BatchNorm2d("fc", (2, 3, 4, 4))):
            x = ca.ones(layer.in_shape, dtype=F32, manager=m)
            with pytest.raises(RuntimeError, match=r"layer fc: .*call layer.init"):
                layer.forward(s, x)
    finally:
        m.close()


# --- backends: the same refusals on both --------------------------------------------------------

def _geometry_calls(be, field, value):
    """Every kernel taking a window geometry, with ``field`` set to ``value``."""
    x, w = z(2, 3, 8, 8), z(4, 3, 3, 3)
    g = {"kernel": 2, "stride": 1, "pad": 1 if field != "kernel" else 0}
    g[field] = value
    p = 9 if field != "kernel" else 7          # the output size of the valid geometry

    def conv():
        be.conv2d_forward(x, w, None, g["stride"], g["pad"], z(2, 4, 8, 8))

    def conv_data():
        be.conv2d_backward_data(z(2, 4, 8, 8), w, g["stride"], g["pad"], z(2, 3, 8, 8))

    def conv_weights():
        be.conv2d_backward_weights(x, z(2, 4, 8, 8), g["stride"], g["pad"], z(4, 3, 3, 3), None)

    def maxpool():
        be.maxpool_forward(x, g["kernel"], g["stride"], g["pad"], z(2, 3, p, p))

    def avgpool():
        be.avgpool_forward(x, g["kernel"], g["stride"], g["pad"], z(2, 3, p, p))

    def avgpool_back():
        be.avgpool_backward(z(2, 3, p, p), g["kernel"], g["stride"], g["pad"], z(2, 3, 8, 8))

    calls = [maxpool, avgpool, avgpool_back]
    return calls if field == "kernel" else [conv, conv_data, conv_weights] + calls


BAD_GEOMETRY = st.one_of(
    st.booleans(), st.text(max_size=2), st.just(None),
    st.floats(allow_nan=True).filter(lambda v: not float(v).is_integer()),
    st.integers(2 ** 31, 2 ** 80), st.integers(-2 ** 40, -1),
    st.tuples(st.just(1), st.sampled_from([1.5, "1", True, 2 ** 70, -2])),
    st.lists(st.just(1), min_size=0, max_size=4).filter(lambda v: len(v) != 2),
)


@pytest.mark.parametrize("field", ["kernel", "stride", "pad"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(value=BAD_GEOMETRY)
def test_both_backends_refuse_geometry_that_is_not_whole_numbers_in_range(field, value):
    for name in BACKENDS:
        for call in _geometry_calls(backends.get_backend(name), field, value):
            with pytest.raises(ValueError, match=f"{call.__name__.split('_')[0]}.*{field}"):
                call()


def test_zero_strides_and_kernels_are_refused_by_both_backends(be):
    with pytest.raises(ValueError, match="conv2d_forward: stride"):
        be.conv2d_forward(z(2, 3, 8, 8), z(4, 3, 3, 3), None, 0, 1, z(2, 4, 8, 8))
    with pytest.raises(ValueError, match="maxpool_forward: kernel"):
        be.maxpool_forward(z(2, 3, 8, 8), (0, 2), 1, 0, z(2, 3, 8, 7))


@pytest.mark.parametrize("w_shape", [(0, 3, 3, 3), (4, 0, 3, 3), (4, 3, 0, 3)])
def test_convolution_weights_with_a_zero_dimension_are_refused_by_both_backends(be, w_shape):
    x = z(2, w_shape[1], 8, 8)
    out = z(2, w_shape[0], 8 - w_shape[2] + 1, 6)
    with pytest.raises(ValueError, match=r"conv2d_forward: w .* has a zero dimension"):
        be.conv2d_forward(x, z(*w_shape), None, 1, 0, out)


@pytest.mark.parametrize("i, o", [(0, 3), (5, 0)])
def test_empty_dense_data_gradients_work_on_both_backends(be, i, o):
    dx = np.full((2, i), np.nan, F32)
    be.dense_backward_data(z(2, o), z(o, i), dx)
    np.testing.assert_array_equal(dx, np.zeros((2, i), F32))


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1.0, 0.0, "1e-5", True, None])
def test_batch_norm_refuses_an_eps_that_gives_nan(be, eps):
    x, c = np.ones((2, 3, 4, 4), F32), z(3)
    with pytest.raises(ValueError, match="batchnorm_forward: eps"):
        be.batchnorm_forward(x, c + 1, c, eps, z(2, 3, 4, 4), z(3), z(3))
    with pytest.raises(ValueError, match="batchnorm_relu_forward: eps|batchnorm_forward: eps"):
        be.batchnorm_relu_forward(x, c + 1, c, eps, z(2, 3, 4, 4), z(3), z(3))
    with pytest.raises(ValueError, match="batchnorm_backward: eps"):
        be.batchnorm_backward(x, x, c + 1, c, c + 1, eps, z(2, 3, 4, 4), z(3), z(3))
    with pytest.raises(ValueError, match="batchnorm_inference: eps"):
        be.batchnorm_inference(x, c + 1, c, c, c + 1, eps, z(2, 3, 4, 4))


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 0, 4, 4), (2, 3, 0, 4)])
def test_training_batch_norm_of_an_empty_batch_is_refused(be, shape):
    c = shape[1]
    with pytest.raises(ValueError, match=r"batchnorm_forward: x .* is empty"):
        be.batchnorm_forward(z(*shape), z(c), z(c), 1e-5, z(*shape), z(c), z(c))
    with pytest.raises(ValueError, match=r"batchnorm(_relu)?_backward: x .* is empty"):
        be.batchnorm_relu_backward(z(*shape), z(*shape), z(*shape), z(c), z(c), z(c), 1e-5,
                                   z(*shape), z(c), z(c))


@pytest.mark.parametrize("start", ["1", 1.7, True, None, 2 ** 40])
def test_channel_offsets_must_be_whole_numbers(be, start):
    with pytest.raises(ValueError, match="slice_channels: "):
        be.slice_channels(z(2, 4, 3, 3), start, z(2, 2, 3, 3))
    with pytest.raises(ValueError, match="place_channels: "):
        be.place_channels(z(2, 2, 3, 3), start, z(2, 4, 3, 3))


@pytest.mark.parametrize("sizes", [[1.5, 1.5], ["1", "2"], [True, 2]])
def test_split_sizes_must_be_whole_numbers(be, sizes):
    with pytest.raises(ValueError, match=r"split_channels: sizes\[0\] must be a whole number"):
        be.split_channels(z(2, 3, 3, 3), sizes, [z(2, 1, 3, 3), z(2, 2, 3, 3)])


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling_refuses_an_output_that_overlaps_its_input(be, kind):
    """oneDNN's pooling, computing in place, reads windows it has already overwritten."""
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(F32)
    before = x.copy()
    pool = be.maxpool_forward if kind == "max" else be.avgpool_forward
    with pytest.raises(ValueError, match=f"{kind}pool_forward: output out .* overlaps input x"):
        pool(x, 1, 1, 0, x)
    with pytest.raises(ValueError, match="overlaps input x"):
        pool(x, 2, 2, 0, x.reshape(-1)[:54].reshape(2, 3, 3, 3))
    np.testing.assert_array_equal(x, before)


# --- oneDNN against the reference on random small shapes ------------------------------------

@st.composite
def layer_cases(draw):
    kind = draw(st.sampled_from(["conv", "maxpool", "avgpool", "batchnorm", "batchnorm_relu",
                                 "dense", "relu", "add"]))
    n, c = draw(st.integers(0, 3)), draw(st.integers(0, 20))     # empty ones included
    h, w = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    geo = {}
    if kind in ("conv", "maxpool", "avgpool"):
        kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        geo = {"kernel": (kh, kw), "stride": (draw(st.integers(1, 3)), draw(st.integers(1, 3))),
               "pad": (draw(st.integers(0, kh - 1)), draw(st.integers(0, kw - 1)))}
        assume(h + 2 * geo["pad"][0] >= kh and w + 2 * geo["pad"][1] >= kw)
        if kind == "conv":
            geo["k"] = draw(st.integers(0, 20))
            geo["bias"] = draw(st.booleans())
    if kind == "dense":
        geo = {"o": draw(st.integers(0, 20)), "bias": draw(st.booleans()), "relu": draw(st.booleans())}
    if kind.startswith("batchnorm"):
        assume(n * h * w != 1)                  # one value per channel: variance 0
    return kind, (n, c, h, w), geo, draw(st.integers(0, 2 ** 32 - 1))


def _run(be, kind, shape, geo, seed):
    """Forward and backward of one layer kind on be: the list of every array computed."""
    rng = np.random.default_rng(seed)

    def r(*s):
        return rng.standard_normal(s).astype(F32)

    n, c, h, w = shape
    x = r(*shape)
    if kind == "conv":
        (kh, kw), st_, pd, k = geo["kernel"], geo["stride"], geo["pad"], geo["k"]
        wt, b = r(k, c, kh, kw), (r(k) if geo["bias"] else None)
        out = np.empty(ref.conv2d_output_shape(shape, wt.shape, st_, pd), F32)
        be.conv2d_forward(x, wt, b, st_, pd, out)
        dy, dx, dw = r(*out.shape), np.empty_like(x), np.empty_like(wt)
        db = np.empty(k, F32) if b is not None else None
        be.conv2d_backward_data(dy, wt, st_, pd, dx)
        be.conv2d_backward_weights(x, dy, st_, pd, dw, db)
        return [out, dx, dw] + ([db] if db is not None else [])
    if kind in ("maxpool", "avgpool"):
        k, st_, pd = geo["kernel"], geo["stride"], geo["pad"]
        oshape = (n, c, (h + 2 * pd[0] - k[0]) // st_[0] + 1, (w + 2 * pd[1] - k[1]) // st_[1] + 1)
        out, dx, dy = np.empty(oshape, F32), np.empty_like(x), r(*oshape)
        if kind == "maxpool":
            state = be.maxpool_forward(x, k, st_, pd, out)
            be.maxpool_backward(dy, x, state, k, st_, pd, dx)
        else:
            be.avgpool_forward(x, k, st_, pd, out)
            be.avgpool_backward(dy, k, st_, pd, dx)
        return [out, dx]
    if kind.startswith("batchnorm"):
        g, bt, dy = r(c), r(c), r(*shape)
        out, mean, var = np.empty_like(x), np.empty(c, F32), np.empty(c, F32)
        dx, dg, db = np.empty_like(x), np.empty(c, F32), np.empty(c, F32)
        if kind == "batchnorm":
            be.batchnorm_forward(x, g, bt, 1e-3, out, mean, var)
            be.batchnorm_backward(dy, x, g, mean, var, 1e-3, dx, dg, db)
        else:
            be.batchnorm_relu_forward(x, g, bt, 1e-3, out, mean, var)
            be.batchnorm_relu_backward(dy, out, x, g, mean, var, 1e-3, dx, dg, db)
        return [out, mean, var, dx, dg, db]
    if kind == "dense":
        x2, o = x.reshape(n, -1), geo["o"]
        wt, b = r(o, x2.shape[1]), (r(o) if geo["bias"] else None)
        out = np.empty((n, o), F32)
        be.dense_forward(x2, wt, b, out, relu=geo["relu"])
        dy, dx, dw = r(n, o), np.empty_like(x2), np.empty_like(wt)
        db = np.empty(o, F32) if b is not None else None
        be.dense_backward_data(dy, wt, dx)
        be.dense_backward_weights(x2, dy, dw, db)
        return [out, dx, dw] + ([db] if db is not None else [])
    dy, out, dx = r(*shape), np.empty_like(x), np.empty_like(x)
    if kind == "relu":
        be.relu_forward(x, out)
        be.relu_backward(dy, x, dx)
    else:
        be.add(x, dy, out)
        be.add(out, x, dx)
    return [out, dx]


@pytest.mark.skipif("onednn" not in BACKENDS, reason="oneDNN backend unavailable")
@settings(max_examples=60, deadline=None)
@given(case=layer_cases())
def test_onednn_agrees_with_the_reference_forward_and_backward(case):
    """The same results, or the same refusal (a ValueError) from both, empty shapes included."""
    def outcome(be):
        try:
            return _run(be, *case)
        except Exception as exc:          # noqa: BLE001 - compared between the backends
            return exc

    expected, actual = outcome(ref), outcome(backends.get_backend("onednn"))
    if isinstance(expected, Exception) or isinstance(actual, Exception):
        assert type(expected) is type(actual) is ValueError, (expected, actual)
        return
    for e, a in zip(expected, actual):
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
        np.testing.assert_allclose(a, e, rtol=2e-4, atol=5e-5 * scale)
