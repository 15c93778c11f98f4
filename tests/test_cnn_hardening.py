"""The CNN session API against hostile input: train_step refuses bad images, labels, optimizers,
models and concurrent steps before any weight changes and leaves the manager as it was; SGD,
Session, build and the backends' kernels refuse what would give wrong numbers."""

import threading

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.models import cnn
from cachedarrays.models.backend import available_backends, get_backend

BACKENDS = available_backends()
SHAPE = dict(batch=2, image=8, classes=5, width=16)


@pytest.fixture(params=BACKENDS)
def trained(request):
    """(manager, session, model, x, labels) of an initialised VGG-11 at test scale."""
    model = cnn.build("vgg", 11, **SHAPE)
    m, s = cnn.make_session("LM", fast="256KiB", slow="32MiB", backend=request.param)
    model.init(s, seed=0)
    x, y = cnn.synthetic_batch(model)
    yield m, s, model, x, y
    m.close()


def _objects(m):
    return len(m.objects())


def _assert_untouched(m, model, before, objects):
    """The weights are those of before and the manager holds the weights alone."""
    after = model.weights()
    assert all(np.array_equal(before[k], after[k], equal_nan=True) for k in before)
    assert _objects(m) == objects


def _bad_images(x):
    nan, inf = x.copy(), x.copy()
    nan[0, 0, 0, 0] = np.nan
    inf[1, 2, 3, 4] = -np.inf
    return [(nan, ValueError, "NaN or infinite"), (inf, ValueError, "NaN or infinite"),
            (x.astype(np.float64) * 1e300, ValueError, "NaN or infinite"),
            (x.astype(np.complex64), TypeError, "real numbers"),
            (np.full(x.shape, "a"), TypeError, "real numbers"),
            (None, TypeError, "real numbers")]


def _bad_labels(y):
    return [(y + 0.5, "integer class indices"), (y.astype(bool), "integer class indices"),
            (np.array([np.nan, 1.0]), "integer class indices"), (y[:1], "shape"),
            (y[:, None], "shape"), (y + 5, "not a class"), (-y - 1, "not a class"),
            (np.array([2**63 + 5, 1], dtype=np.uint64), "9223372036854775813")]


def test_train_step_refuses_bad_images_and_labels_before_any_weight_changes(trained):
    m, s, model, x, y = trained
    opt = cnn.SGD(0.1)
    before, objects = model.weights(), _objects(m)
    for bad, exc, words in _bad_images(x):
        with pytest.raises(exc, match=words):
            cnn.train_step(s, model, bad, y, opt)
    for bad, words in _bad_labels(y):
        with pytest.raises(ValueError, match=words):
            cnn.train_step(s, model, x, bad, opt)
    with ca.Manager(fast="64KiB", slow="1MiB") as other:
        for xa, ya in ((ca.asarray(x, manager=other), y), (x, ca.asarray(y, manager=other))):
            with pytest.raises(ValueError, match="CachedArray of another manager"):
                cnn.train_step(s, model, xa, ya, opt)
    x64 = ca.asarray(x.astype(np.float64), manager=m)
    with pytest.raises(ValueError, match="the session computes in float32"):
        cnn.train_step(s, model, x64, y, opt)
    ca.unsafe_free(x64)
    _assert_untouched(m, model, before, objects)
    assert np.isfinite(cnn.train_step(s, model, x.astype(np.int32), list(y), opt))


def test_a_nan_loss_is_refused_before_the_backward_pass(trained):
    m, s, model, x, y = trained
    p = next(p for p in model.params() if p.name == "fc3.w")
    with ca.writable(p.value) as w:
        w[0] = np.nan                  # diverged weights: a logit of every image is NaN
    before, objects = model.weights(), _objects(m)
    with pytest.raises(FloatingPointError, match="weights were left as they were"):
        cnn.train_step(s, model, x, y, cnn.SGD(0.1))
    xa = ca.asarray(x, manager=m)      # a CachedArray input is not scanned: the loss tells
    with pytest.raises(FloatingPointError):
        cnn.train_step(s, model, xa, y, cnn.SGD(0.1))
    ca.unsafe_free(xa)
    _assert_untouched(m, model, before, objects)
    assert s.fused is None


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -0.1, "0.1", True, None])
def test_sgd_refuses_a_learning_rate_that_ruins_the_weights(lr):
    with pytest.raises(ValueError, match="finite number >= 0"):
        cnn.SGD(lr)
    opt = cnn.SGD(0.01)
    with pytest.raises(ValueError, match="finite number >= 0"):
        opt.lr = lr
    assert opt.lr == 0.01 and cnn.SGD(np.float32(0.5)).lr == 0.5 and cnn.SGD(0).lr == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_kernels_refuse_a_bad_learning_rate_and_an_empty_batch(backend):
    be = get_backend(backend)
    p, g = np.ones(4, np.float32), np.ones(4, np.float32)
    for lr in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="sgd_update: learning rate"):
            be.sgd_update(p, g, lr)
    assert np.array_equal(p, np.ones(4, np.float32))
    for n, c in ((0, 5), (2, 0)):
        logits = np.zeros((n, c), np.float32)
        with pytest.raises(ValueError, match="at least one row"):
            be.softmax_cross_entropy(logits, np.zeros(n, np.int64), np.empty_like(logits))


def test_train_step_refuses_a_missing_optimizer_and_an_uninitialised_model(trained):
    m, s, model, x, y = trained
    for opt, fused in ((None, True), (object(), True), (lambda s, p: None, False)):
        with pytest.raises(TypeError, match="optimizer must have the"):
            cnn.train_step(s, model, x, y, opt, fused=fused)
    fresh = cnn.build("vgg", 11, **SHAPE)
    with pytest.raises(RuntimeError, match=r"no parameters yet; call model.init"):
        cnn.train_step(s, fresh, x, y, cnn.SGD(0.1))


def test_a_model_trains_only_with_the_manager_and_dtype_it_was_initialised_with(trained):
    m, s, model, x, y = trained
    with ca.Manager(fast="256KiB", slow="32MiB") as other:
        with pytest.raises(ValueError, match="belong to another manager"):
            cnn.train_step(cnn.Session(other, s.be), model, x, y, cnn.SGD(0.1))
    if s.be.name == "numpy":
        with pytest.raises(ValueError, match="session computes in float64"):
            cnn.train_step(cnn.Session(m, "numpy", dtype=np.float64), model, x, y, cnn.SGD(0.1))
    m.close()
    with pytest.raises(ca.UseAfterFreeError, match="closed"):
        cnn.train_step(s, model, x, y, cnn.SGD(0.1))


def test_a_session_refuses_a_bad_manager_backend_or_dtype():
    with ca.Manager(fast="64KiB", slow="1MiB") as m:
        with pytest.raises(TypeError, match="manager must be a ca.Manager"):
            cnn.Session(None)
        with pytest.raises(TypeError, match="backend must be a name"):
            cnn.Session(m, None)
        with pytest.raises(ValueError, match="unknown backend"):
            cnn.Session(m, "torch")
        for dtype in (np.int32, np.float16):
            with pytest.raises(ValueError, match="not computed by the numpy backend"):
                cnn.Session(m, "numpy", dtype=dtype)
        if "onednn" in BACKENDS:
            with pytest.raises(ValueError, match="onednn backend; use float32"):
                cnn.Session(m, "onednn", dtype=np.float64)


@pytest.mark.parametrize("key,value", [("batch", 1.5), ("batch", True), ("image", float("nan")),
                                       ("classes", 0), ("channels", "3"), ("width", float("nan")),
                                       ("width", float("inf")), ("width", "2"), ("width", 0)])
def test_build_refuses_sizes_that_are_not_whole_positive_numbers(key, value):
    with pytest.raises(ValueError, match=key):
        cnn.build("vgg", 11, **{**SHAPE, key: value})
    assert cnn.build("vgg", 11, **{**SHAPE, "batch": 2.0}).input_shape[0] == 2


def test_one_model_or_session_trains_in_one_thread_at_a_time(trained):
    m, s, model, x, y = trained
    inside, go, errors = threading.Event(), threading.Event(), []
    layer = model.units[0]
    forward = layer.forward

    def slow_forward(s_, x_):
        inside.set()
        go.wait(10)
        return forward(s_, x_)

    layer.forward = slow_forward
    t = threading.Thread(target=lambda: cnn.train_step(s, model, x, y, cnn.SGD(0.1)))
    t.start()
    try:
        assert inside.wait(10)
        other = cnn.build("vgg", 11, **SHAPE).init(s, seed=1)
        for sess, mod in ((s, model), (s, other), (cnn.Session(m, s.be), model)):
            try:
                cnn.train_step(sess, mod, x, y, cnn.SGD(0.1))
            except RuntimeError as e:
                errors.append(str(e))
    finally:
        go.set()
        t.join(30)
        del layer.forward
    assert len(errors) == 3 and all("already in a training step" in e for e in errors)
    assert np.isfinite(cnn.train_step(s, model, x, y, cnn.SGD(0.1)))     # released after


@pytest.mark.parametrize("kw", [dict(iterations=0), dict(iterations=-1), dict(iterations=1.5),
                                dict(footprint=-5), dict(footprint=float("nan"))])
def test_run_refuses_iterations_and_footprints_that_are_not_counts(kw):
    args = dict(iterations=1, fast="25%", footprint=1 << 20, **SHAPE)
    args.update(kw)
    with pytest.raises(ValueError, match=next(iter(kw))):
        cnn.run("vgg", 11, **args)


def test_init_takes_a_session():
    with pytest.raises(TypeError, match="init takes a cnn.Session"):
        cnn.build("vgg", 11, **SHAPE).init(None)
