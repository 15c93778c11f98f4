"""CNN layers in rrule style: ``forward(session, x)`` returns ``(y, pullback)``; pullback(dy) -> dx.

Shapes are fixed when a layer is built (so a model knows its footprint before it allocates and
every mismatch names the layer). Parameters and activations are CachedArrays; every kernel runs
through ``Session.kernel``. The backward pass writes each parameter's gradient into a new array
(``Param.grad``) and calls ``Session.grads_ready``, where a fused optimizer applies it at once.

Early frees (``Session.release``, only with the memory optimisations on): in reverse mode every
consumer's pullback runs before its producer's, so a layer's pullback frees the output it made
in the forward pass, and the state it saved, as soon as its own kernels have run. A Chain frees
the gradients passed between its layers once the next pullback consumed them.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from cachedarrays.copyengine import check_switch

from .core import F32, Unit

__all__ = ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "AvgPool2d", "Flatten", "Dense",
           "Chain", "add", "softmax_cross_entropy"]


_GEOMETRY_LIMIT = 1 << 31       # as the backends' (``_checks.GEOMETRY_LIMIT``)


def _whole(name, what, v, low, high=None):
    """v as an int: a whole number (an int, or a float without a fraction; not a bool or a
    string) in [low, high); raises ValueError naming the layer and the argument."""
    ok = isinstance(v, (numbers.Integral, numbers.Real)) and not isinstance(v, (bool, np.bool_))
    if ok:
        ok = math.isfinite(v) and int(v) == v and v >= low and (high is None or v < high)
    if not ok:
        bound = f">= {low}" if high is None else f"in [{low}, 2**31)"
        raise ValueError(f"layer {name}: {what} must be a whole number {bound}, got {v!r}")
    return int(v)


def _pair(v, name="?", what="size", low=0):
    """(height, width) from an int or a pair of whole numbers >= low."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
        v = (v, v)
    elif len(v) != 2:
        raise ValueError(f"layer {name}: {what} must be an int or a pair (height, width), got {v!r}")
    return tuple(_whole(name, what, a, low, _GEOMETRY_LIMIT) for a in v)


def _shape(name, shape, ndim=None):
    """shape as a tuple of whole numbers >= 1 (of ndim dimensions when given)."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__"):
        raise ValueError(f"layer {name}: input shape must be a tuple of sizes, got {shape!r}")
    if ndim is not None and len(shape) != ndim:
        form = "(N,C,H,W)" if ndim == 4 else "(N, features)"
        raise ValueError(f"layer {name}: expects a {ndim}-d {form} input, got shape {tuple(shape)}")
    if not shape:
        raise ValueError(f"layer {name}: input shape must have at least one dimension")
    return tuple(_whole(name, "every input size (batch included)", d, 1) for d in shape)


def _nbytes(shape):
    return 4 * math.prod(shape)


def _window_shape(name, in_shape, channels, kernel, stride, pad):
    """(N, channels, P, Q) of a window op; raises naming the layer when the input is too small."""
    n, _, h, w = in_shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad
    if h + 2 * ph < kh or w + 2 * pw < kw:
        raise ValueError(f"layer {name}: input {h}x{w} (pad {ph}) is smaller than its {kh}x{kw} "
                         "window; use a larger image or a shallower model")
    return (n, channels, (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1)


def _initialised(layer, *params):
    """Raise naming the layer when its parameters were never made (``init`` not called)."""
    if any(p is None for p in params):
        raise RuntimeError(f"layer {layer.name}: has no parameters yet; call "
                           "layer.init(session, rng) (or model.init(session)) before forward")


class _Weighted(Unit):
    """A unit with a weight ``w`` (He-initialised, fan-in = the product of w's trailing dims)
    and an optional bias ``b``."""

    def init(self, s, rng):
        fan_in = math.prod(self.w_shape[1:])
        w = rng.standard_normal(self.w_shape, dtype=F32) * np.float32(math.sqrt(2.0 / fan_in))
        self.w = s.param(f"{self.name}.w", w)
        if self.has_bias:
            self.b = s.param(f"{self.name}.b", np.zeros(self.w_shape[0], F32))

    def param_count(self):
        return math.prod(self.w_shape) + (self.w_shape[0] if self.has_bias else 0)

    def activation_bytes(self):
        return _nbytes(self.out_shape)


class Conv2d(_Weighted):
    """2-d convolution (NCHW, KCRS weights), optional fused bias; He-normal initialisation."""

    def __init__(self, name, in_shape, out_channels, kernel, stride=1, pad=0, bias=False,
                 need_dx=True):
        self.name, self.in_shape = name, _shape(name, in_shape, 4)
        self.stride, self.pad = _pair(stride, name, "stride", 1), _pair(pad, name, "pad")
        kernel = _pair(kernel, name, "kernel", 1)
        out_channels = _whole(name, "out_channels", out_channels, 1)
        self.w_shape = (out_channels, self.in_shape[1], *kernel)
        self.out_shape = _window_shape(name, self.in_shape, out_channels, kernel, self.stride,
                                       self.pad)
        self.has_bias = check_switch(bias, "Conv2d: bias")
        self.need_dx = check_switch(need_dx, "Conv2d: need_dx")
        self.w = self.b = None


    def forward(self, s, x):
        self.check_input(x)
        _initialised(self, self.w, *((self.b,) if self.has_bias else ()))
        be, st, pd = s.be, self.stride, self.pad
        w = self.w.value
        b = self.b.value if self.b is not None else None
        y = s.empty(self.out_shape)
        s.kernel("conv2d_forward", lambda xv, wv, bv, yv: be.conv2d_forward(xv, wv, bv, st, pd, yv),
                 (x, w, b), (y,))
        pw, pb = self.w, self.b
        in_shape, need_dx = self.in_shape, self.need_dx

        def pullback(dy):
            dx = None
            if need_dx:
                dx = s.empty(in_shape)
                s.kernel("conv2d_backward_data",
                         lambda d, wv, o: be.conv2d_backward_data(d, wv, st, pd, o), (dy, w), (dx,))
            gw, gb = pw.new_grad(s), (pb.new_grad(s) if pb is not None else None)
            s.kernel("conv2d_backward_weights",
                     lambda xv, d, dw, db: be.conv2d_backward_weights(xv, d, st, pd, dw, db),
                     (x, dy), (gw, gb))
            s.grads_ready(pw, pb)          # after backward_data: it needed the old weights
            s.release(y)
            return dx

        return y, pullback


class BatchNorm2d(Unit):
    """Training-mode batch normalisation over N,H,W with learnt scale and shift."""

    eps = 1e-5

    def __init__(self, name, in_shape):
        self.name, self.in_shape = name, _shape(name, in_shape, 4)
        self.out_shape = self.in_shape
        self.gamma = self.beta = None

    def init(self, s, rng):
        c = self.in_shape[1]
        self.gamma = s.param(f"{self.name}.gamma", np.ones(c, F32))
        self.beta = s.param(f"{self.name}.beta", np.zeros(c, F32))

    def param_count(self):
        return 2 * self.in_shape[1]

    def activation_bytes(self):
        return _nbytes(self.out_shape) + 8 * self.in_shape[1]

    def forward(self, s, x, relu=False):
        """relu: apply a following ReLU in the same kernel (``Chain`` fuses BatchNorm2d, ReLU
        pairs); the pullback then masks the incoming gradient by the output."""
        self.check_input(x)
        _initialised(self, self.gamma, self.beta)
        be, eps, c = s.be, self.eps, self.in_shape[1]
        g, b = self.gamma.value, self.beta.value
        y, mean, var = s.empty(self.out_shape), s.empty((c,)), s.empty((c,))
        if relu:
            s.kernel("batchnorm_relu_forward",
                     lambda xv, gv, bv, yv, mv, vv:
                     be.batchnorm_relu_forward(xv, gv, bv, eps, yv, mv, vv),
                     (x, g, b), (y, mean, var))
        else:
            s.kernel("batchnorm_forward",
                     lambda xv, gv, bv, yv, mv, vv: be.batchnorm_forward(xv, gv, bv, eps, yv, mv, vv),
                     (x, g, b), (y, mean, var))
        pg, pb, in_shape, name = self.gamma, self.beta, self.in_shape, self.name

        def pullback(dy, acc=None):
            if acc is not None and not relu:
                raise ValueError(f"layer {name}: only a fused batch norm and ReLU adds a "
                                 "gradient (acc) to dx")
            dx = s.empty(in_shape)
            dg, db = pg.new_grad(s), pb.new_grad(s)
            if acc is not None:
                s.kernel("batchnorm_relu_backward",
                         lambda d, yv, xv, gv, mv, vv, av, o, dgv, dbv:
                         be.batchnorm_relu_backward(d, yv, xv, gv, mv, vv, eps, o, dgv, dbv,
                                                    acc=av),
                         (dy, y, x, g, mean, var, acc), (dx, dg, db))
            elif relu:
                s.kernel("batchnorm_relu_backward",
                         lambda d, yv, xv, gv, mv, vv, o, dgv, dbv:
                         be.batchnorm_relu_backward(d, yv, xv, gv, mv, vv, eps, o, dgv, dbv),
                         (dy, y, x, g, mean, var), (dx, dg, db))
            else:
                s.kernel("batchnorm_backward",
                         lambda d, xv, gv, mv, vv, o, dgv, dbv:
                         be.batchnorm_backward(d, xv, gv, mv, vv, eps, o, dgv, dbv),
                         (dy, x, g, mean, var), (dx, dg, db))
            s.grads_ready(pg, pb)
            s.release(y, mean, var)
            return dx

        pullback.accumulates = relu     # pullback(dy, acc) adds acc[:, :C] to dx
        return y, pullback


class ReLU(Unit):
    """max(x, 0), computed in place (the input is never needed again); backward from the output."""

    def __init__(self, name, in_shape):
        self.name, self.in_shape = name, _shape(name, in_shape)
        self.out_shape = self.in_shape

    def param_count(self):
        return 0

    def activation_bytes(self):
        return 0

    def forward(self, s, x):
        self.check_input(x)
        be = s.be
        s.kernel("relu_forward", lambda xr, xw: be.relu_forward(xw, xw), (x,), (x,))
        y = x

        def pullback(dy):
            dx = s.empty(dy.shape)
            s.kernel("relu_backward", lambda d, yv, o: be.relu_backward(d, yv, o), (dy, y), (dx,))
            return dx

        return y, pullback


class _Pool(Unit):
    """A pooling window: kernel >= 1, stride >= 1 (default: the kernel), 0 <= pad < kernel."""

    def _geometry(self, kernel, stride, pad):
        name = self.name
        self.kernel = _pair(kernel, name, "kernel", 1)
        self.stride = self.kernel if stride is None else _pair(stride, name, "stride", 1)
        self.pad = _pair(pad, name, "pad")
        if self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]:
            raise ValueError(f"layer {name}: pad {self.pad} must be smaller than the kernel "
                             f"{self.kernel} (a window of padding alone has no value)")


class MaxPool2d(_Pool):
    """Max pooling; the backend's state (argmax / workspace) is saved instead of the input."""

    def __init__(self, name, in_shape, kernel, stride=None, pad=0):
        self.name, self.in_shape = name, _shape(name, in_shape, 4)
        self._geometry(kernel, stride, pad)
        self.out_shape = _window_shape(name, self.in_shape, self.in_shape[1], self.kernel,
                                       self.stride, self.pad)

    def param_count(self):
        return 0

    def activation_bytes(self):
        return _nbytes(self.out_shape) + math.prod(self.out_shape)

    def forward(self, s, x):
        self.check_input(x)
        be, k, st, pd = s.be, self.kernel, self.stride, self.pad
        y = s.empty(self.out_shape)
        shape, dtype = be.maxpool_state_spec(self.in_shape, self.out_shape, k)
        state = s.empty(shape, dtype)
        s.kernel("maxpool_forward", lambda xv, yv, sv: be.maxpool_forward(xv, k, st, pd, yv, sv),
                 (x,), (y, state))
        in_shape = self.in_shape

        def pullback(dy):
            dx = s.empty(in_shape)
            s.kernel("maxpool_backward",
                     lambda d, sv, o: be.maxpool_backward(d, None, sv, k, st, pd, o),
                     (dy, state), (dx,))
            s.release(y, state)
            return dx

        return y, pullback


class AvgPool2d(_Pool):
    """Average pooling (padding excluded); ``kernel=None`` pools globally to 1x1."""

    def __init__(self, name, in_shape, kernel=None, stride=None, pad=0):
        self.name, self.in_shape = name, _shape(name, in_shape, 4)
        if kernel is None:
            kernel = self.in_shape[2:]
        self._geometry(kernel, stride, pad)
        self.out_shape = _window_shape(name, self.in_shape, self.in_shape[1], self.kernel,
                                       self.stride, self.pad)

    def param_count(self):
        return 0

    def activation_bytes(self):
        return _nbytes(self.out_shape)

    def forward(self, s, x):
        self.check_input(x)
        be, k, st, pd = s.be, self.kernel, self.stride, self.pad
        y = s.empty(self.out_shape)
        s.kernel("avgpool_forward", lambda xv, yv: be.avgpool_forward(xv, k, st, pd, yv), (x,), (y,))
        in_shape = self.in_shape

        def pullback(dy):
            dx = s.empty(in_shape)
            s.kernel("avgpool_backward", lambda d, o: be.avgpool_backward(d, k, st, pd, o), (dy,), (dx,))
            s.release(y)
            return dx

        return y, pullback


class Flatten(Unit):
    """(N, C, H, W) -> (N, C*H*W) as a view (no copy); the gradient is reshaped back."""

    def __init__(self, name, in_shape):
        self.name, self.in_shape = name, _shape(name, in_shape)
        if len(self.in_shape) < 2:
            raise ValueError(f"layer {name}: expects an (N, ...) input of at least 2 dimensions, "
                             f"got shape {self.in_shape}")
        self.out_shape = (self.in_shape[0], math.prod(self.in_shape[1:]))

    def param_count(self):
        return 0

    def activation_bytes(self):
        return 0

    def forward(self, s, x):
        self.check_input(x)
        in_shape = self.in_shape

        def pullback(dy):
            return dy.reshape(in_shape)

        return x.reshape(self.out_shape), pullback


class Dense(_Weighted):
    """Fully connected layer y = x @ w.T + b with w (out, in)."""

    def __init__(self, name, in_shape, out_features, bias=True, need_dx=True):
        self.name, self.in_shape = name, _shape(name, in_shape, 2)
        out_features = _whole(name, "out_features", out_features, 1)
        self.w_shape = (out_features, self.in_shape[1])
        self.out_shape = (self.in_shape[0], out_features)
        self.has_bias = check_switch(bias, "Dense: bias")
        self.need_dx = check_switch(need_dx, "Dense: need_dx")
        self.w = self.b = None


    def forward(self, s, x):
        self.check_input(x)
        _initialised(self, self.w, *((self.b,) if self.has_bias else ()))
        be = s.be
        w = self.w.value
        b = self.b.value if self.b is not None else None
        y = s.empty(self.out_shape)
        s.kernel("dense_forward", lambda xv, wv, bv, yv: be.dense_forward(xv, wv, bv, yv), (x, w, b), (y,))
        pw, pb = self.w, self.b
        in_shape, need_dx = self.in_shape, self.need_dx

        def pullback(dy):
            dx = None
            if need_dx:
                dx = s.empty(in_shape)
                s.kernel("dense_backward_data", lambda d, wv, o: be.dense_backward_data(d, wv, o),
                         (dy, w), (dx,))
            gw, gb = pw.new_grad(s), (pb.new_grad(s) if pb is not None else None)
            s.kernel("dense_backward_weights",
                     lambda xv, d, dw, db: be.dense_backward_weights(xv, d, dw, db), (x, dy), (gw, gb))
            s.grads_ready(pw, pb)
            s.release(y)
            return dx

        return y, pullback


class Chain(Unit):
    """Layers applied in order; the pullback runs theirs in reverse. A batch norm followed by a
    ReLU runs as one fused kernel each way when the backend has them (same results: the ReLU's
    mask is the fused output's sign)."""

    def __init__(self, name, layers):
        self.name = name
        self.layers = list(layers)
        if not self.layers:
            raise ValueError(f"layer {name}: a chain needs at least one layer")
        self.in_shape, self.out_shape = self.layers[0].in_shape, self.layers[-1].out_shape

    def forward(self, s, x):
        pullbacks = []
        layers, i = self.layers, 0
        fuse = hasattr(s.be, "batchnorm_relu_forward")
        while i < len(layers):
            layer = layers[i]
            if (fuse and type(layer) is BatchNorm2d and i + 1 < len(layers)
                    and type(layers[i + 1]) is ReLU):
                layers[i + 1].check_input(x)
                x, pb = layer.forward(s, x, relu=True)      # one kernel each way for the pair
                i += 2
            else:
                x, pb = layer.forward(s, x)
                i += 1
            pullbacks.append(pb)
        first = pullbacks[0]

        def pullback(dy, acc=None):
            """acc (when ``pullback.accumulates``): added to dx by the first layer's kernel."""
            g = dy
            for pb in reversed(pullbacks):
                dg = pb(g, acc) if pb is first and acc is not None else pb(g)
                if g is not dy and (dg is None or dg.object is not g.object):  # Flatten: a view
                    s.release(g)
                g = dg
            return g

        pullback.accumulates = getattr(first, "accumulates", False)
        return x, pullback


def add(s, a, b, out=None):
    """a + b into a new array (or into ``out``, which may be a: an in-place accumulate)."""
    if out is None:
        out = s.empty(a.shape)
    be = s.be
    if out is a:
        s.kernel("add", lambda av, bv, o: be.add(o, bv, o), (a, b), (out,))
    else:
        s.kernel("add", lambda av, bv, o: be.add(av, bv, o), (a, b), (out,))
    return out


def softmax_cross_entropy(s, logits, labels):
    """(mean loss as a float, d loss / d logits as a new array)."""
    be = s.be
    dlogits = s.empty(logits.shape)
    loss = s.kernel("softmax_cross_entropy", lambda lv, yv, d: be.softmax_cross_entropy(lv, yv, d),
                    (logits, labels), (dlogits,))
    return float(loss), dlogits
