"""VGG, ResNet and DenseNet built from the rrule layers, and the annotated training step.

A model is a list of *units*; each unit is annotated as a whole (``Session.rrule``): VGG's
units are single layers, ResNet's are residual blocks, DenseNet's are dense layers (the
bottleneck and its concatenation) and transitions, so cleanup never frees what a later
pullback still needs. ``width`` divides every channel count, so the same architecture runs at
test scale (e.g. 16x16 images, width 16) and at benchmark scale (width 1).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading

import numpy as np

import cachedarrays as ca
from cachedarrays.copyengine import check_switch

from .core import Session, Unit
from .layers import (AvgPool2d, BatchNorm2d, Chain, Conv2d, Dense, Flatten, MaxPool2d, ReLU, add,
                     softmax_cross_entropy)

__all__ = ["Model", "ResidualBlock", "DenseLayer", "build", "vgg", "resnet", "densenet",
           "train_step", "MODELS", "VGG_DEPTHS", "RESNET_DEPTHS", "DENSENET_DEPTHS"]


def _vgg_stages(depth):
    """Convolutions per stage for VGG-depth (3 dense layers; extra depth goes to stages 3-5)."""
    fixed = {11: [1, 1, 2, 2, 2], 13: [2, 2, 2, 2, 2], 16: [2, 2, 3, 3, 3], 19: [2, 2, 4, 4, 4]}
    if depth in fixed:
        return fixed[depth]
    rest = depth - 3 - 4
    return [2, 2] + [rest // 3 + (1 if i < rest % 3 else 0) for i in range(3)]


VGG_DEPTHS = (11, 13, 16, 19, 116, 416)
RESNET_DEPTHS = {18: ("basic", [2, 2, 2, 2]), 34: ("basic", [3, 4, 6, 3]),
                 50: ("bottleneck", [3, 4, 6, 3]), 101: ("bottleneck", [3, 4, 23, 3]),
                 152: ("bottleneck", [3, 8, 36, 3]), 200: ("bottleneck", [3, 24, 36, 3])}
DENSENET_DEPTHS = {121: [6, 12, 24, 16], 169: [6, 12, 32, 32], 201: [6, 12, 48, 32],
                   264: [6, 12, 64, 48]}


def _ch(c, width):
    """c channels divided by the width factor (at least 1)."""
    return max(1, int(round(c / width)))


class Model:
    """A named list of units with the input shape and class count it was built for."""

    def __init__(self, name, units, input_shape, classes):
        self.name, self.units = name, list(units)
        self.input_shape, self.classes = tuple(input_shape), int(classes)
        self.initialized = False

    def params(self):
        out = []
        for u in self.units:
            out.extend(u.params())
        return out

    def param_count(self):
        return sum(u.param_count() for u in self.units)

    def footprint_estimate(self):
        """Approximate bytes one training iteration needs with cleanup on (weights, gradients,
        saved activations, the input and the largest backward temporaries)."""
        acts = sum(u.activation_bytes() for u in self.units)
        largest = max(4 * math.prod(u.out_shape) for u in self.units)
        inp = 4 * math.prod(self.input_shape)
        return 8 * self.param_count() + acts + 3 * largest + 2 * inp

    def init(self, s, seed=0):
        """Allocate and initialise every parameter (deterministic in seed) through s's manager."""
        if not isinstance(s, Session):
            raise TypeError(f"model {self.name}: init takes a cnn.Session, got "
                            f"{type(s).__name__}; e.g. model.init(cnn.make_session(...)[1])")
        rng = np.random.default_rng(seed)
        for u in self.units:
            u.init(s, rng)
        self.initialized = True
        return self

    def weights(self):
        """Copies of every parameter value, as ndarrays (name -> array)."""
        out = {}
        for p in self.params():
            with ca.readable(p.value) as v:
                out[p.name] = np.array(v)
        return out

    def forward(self, s, x, tape):
        """Annotated forward pass; appends each unit's pullback to tape; returns the logits."""
        if tuple(x.shape) != self.input_shape:
            raise ValueError(f"model {self.name}: input has shape {tuple(x.shape)}, but it was built "
                             f"for {self.input_shape}; build it with that batch, channels and image")
        for u in self.units:
            x, pb = s.rrule(u, x)
            tape.append(pb)
        return x

    def __repr__(self):
        return f"<Model {self.name} input {self.input_shape} {len(self.units)} units>"


class ResidualBlock(Unit):
    """Basic (two 3x3) or bottleneck (1x1, 3x3, 1x1 x4) residual block with projection shortcut."""

    def __init__(self, name, in_shape, planes, stride, bottleneck):
        self.name, self.in_shape = name, tuple(in_shape)
        cin = self.in_shape[1]
        out_c = planes * 4 if bottleneck else planes
        if bottleneck:
            c1 = Conv2d(f"{name}.conv1", in_shape, planes, 1)
            b1 = BatchNorm2d(f"{name}.bn1", c1.out_shape)
            r1 = ReLU(f"{name}.relu1", c1.out_shape)
            c2 = Conv2d(f"{name}.conv2", c1.out_shape, planes, 3, stride, 1)
            b2 = BatchNorm2d(f"{name}.bn2", c2.out_shape)
            r2 = ReLU(f"{name}.relu2", c2.out_shape)
            c3 = Conv2d(f"{name}.conv3", c2.out_shape, out_c, 1)
            b3 = BatchNorm2d(f"{name}.bn3", c3.out_shape)
            layers = [c1, b1, r1, c2, b2, r2, c3, b3]
        else:
            c1 = Conv2d(f"{name}.conv1", in_shape, planes, 3, stride, 1)
            b1 = BatchNorm2d(f"{name}.bn1", c1.out_shape)
            r1 = ReLU(f"{name}.relu1", c1.out_shape)
            c2 = Conv2d(f"{name}.conv2", c1.out_shape, planes, 3, 1, 1)
            b2 = BatchNorm2d(f"{name}.bn2", c2.out_shape)
            layers = [c1, b1, r1, c2, b2]
        self.branch = Chain(f"{name}.branch", layers)
        self.out_shape = self.branch.out_shape
        self.shortcut = None
        if stride != 1 or cin != out_c:
            sc = Conv2d(f"{name}.downsample", in_shape, out_c, 1, stride)
            self.shortcut = Chain(f"{name}.shortcut", [sc, BatchNorm2d(f"{name}.downsample_bn", sc.out_shape)])
        self.relu = ReLU(f"{name}.relu", self.out_shape)

    def activation_bytes(self):
        return super().activation_bytes() + 4 * math.prod(self.out_shape)

    def forward(self, s, x):
        self.check_input(x)
        h, pb_branch = self.branch.forward(s, x)
        if self.shortcut is not None:
            sc, pb_short = self.shortcut.forward(s, x)
        else:
            sc, pb_short = x, None
        z = add(s, h, sc)
        s.release(h, sc if self.shortcut is not None else None)   # the sum is all backward needs
        y, pb_relu = self.relu.forward(s, z)

        def pullback(dy):
            dz = pb_relu(dy)
            s.release(y)                   # read by the ReLU's pullback only
            dx = pb_branch(dz)
            ds = pb_short(dz) if pb_short is not None else dz
            add(s, dx, ds, out=dx)
            s.release(dz, ds if ds is not dz else None)
            return dx

        return y, pullback


class DenseLayer(Unit):
    """DenseNet-B layer: BN-ReLU-Conv1x1(4k)-BN-ReLU-Conv3x3(k), concatenated to its input.

    Concatenation in place: a dense block's layers share one buffer of the block's final
    channel count (``block_channels``; by default this layer's output alone). The block's first
    layer (``first``) allocates it and writes its input into the first channels; every layer
    writes its k new channels into their slice and returns the whole buffer, and the next layer
    reads the channel prefix it was built for (a strided view, no copy). So a layer built for
    ``in_shape`` (N, c, H, W) takes, unless it is the first, the buffer (N, block_channels, H, W)
    of which channels :c are written, and returns the buffer with channels :c + k written. The
    buffer is freed when the block's first layer's pullback (the last of the block) has run.

    Backward: the gradient of the concatenation is not split. Only its k new channels are
    copied out (the inner chain's input gradient); the first kernel of the inner chain's
    backward (its fused batch norm and ReLU) adds the first c channels to the dx it writes,
    so dx = dy[:, :c] + d(inner)/dx costs no pass of its own (backends without the fused
    kernels split and add)."""

    def __init__(self, name, in_shape, growth, bn_size=4, block_channels=None, first=True):
        self.name, self.in_shape = name, tuple(in_shape)
        n, c, h, w = self.in_shape
        b1 = BatchNorm2d(f"{name}.bn1", in_shape)
        r1 = ReLU(f"{name}.relu1", in_shape)
        c1 = Conv2d(f"{name}.conv1", in_shape, bn_size * growth, 1)
        b2 = BatchNorm2d(f"{name}.bn2", c1.out_shape)
        r2 = ReLU(f"{name}.relu2", c1.out_shape)
        c2 = Conv2d(f"{name}.conv2", c1.out_shape, growth, 3, 1, 1)
        self.inner = Chain(f"{name}.inner", [b1, r1, c1, b2, r2, c2])
        self.growth = growth
        self.out_shape = (n, c + growth, h, w)
        cb = c + growth if block_channels is None else int(block_channels)
        if cb < c + growth:
            raise ValueError(f"layer {name}: block_channels {cb} must hold the input's {c} "
                             f"channels and the {growth} new ones")
        self.buffer_shape = (n, cb, h, w)
        self.first = bool(first)

    def activation_bytes(self):
        # The block's buffer is counted once, by its first layer.
        return super().activation_bytes() + (4 * math.prod(self.buffer_shape) if self.first else 0)

    def check_input(self, x):
        if self.first:
            return super().check_input(x)
        if tuple(x.shape) != self.buffer_shape:
            raise ValueError(f"layer {self.name}: input has shape {tuple(x.shape)}, expected "
                             f"the dense block's buffer {self.buffer_shape} (channels "
                             f":{self.in_shape[1]} written by the layers before it)")

    def forward(self, s, x):
        self.check_input(x)
        be = s.be
        c, k = self.in_shape[1], self.growth
        if self.first:
            buf, xin = s.empty(self.buffer_shape), x
            s.kernel("place_channels", lambda a, o: be.place_channels(a, 0, o), (x,), (buf,),
                     pure=False)
        else:
            buf, xin = x, x[:, :c]       # the channels written so far: a strided view
        new, pb_inner = self.inner.forward(s, xin)
        s.kernel("place_channels", lambda a, o: be.place_channels(a, c, o), (new,), (buf,),
                 pure=False)
        s.release(new)                   # the buffer holds a copy
        y, first, new_shape = buf, self.first, new.shape

        if getattr(pb_inner, "accumulates", False) and hasattr(be, "slice_channels"):
            def pullback(dy):
                # dx = dy[:, :c] + d(inner)/dx: the inner chain's first kernel (batch norm and
                # ReLU) adds dy's first c channels itself, so only the new channels are copied.
                dnew = s.empty(new_shape)
                s.kernel("slice_channels", lambda d, o: be.slice_channels(d, c, o), (dy,), (dnew,))
                dx = pb_inner(dnew, acc=dy)
                s.release(dnew)
                if first:                # the block's last pullback: the buffer is done
                    s.release(y)
                return dx

            return y, pullback

        in_shape = self.in_shape

        def pullback(dy):
            dx, dnew = s.empty(in_shape), s.empty(new_shape)
            s.kernel("split_channels", lambda d, o1, o2: be.split_channels(d, [c, k], [o1, o2]),
                     (dy,), (dx, dnew))
            dinner = pb_inner(dnew)
            add(s, dx, dinner, out=dx)
            s.release(dnew, dinner)
            if first:
                s.release(y)
            return dx

        return y, pullback


def _head(name, shape, classes, width, with_bn_relu=False):
    units = []
    if with_bn_relu:
        units += [BatchNorm2d(f"{name}.bn", shape), ReLU(f"{name}.relu", shape)]
    pool = AvgPool2d(f"{name}.avgpool", shape)
    flat = Flatten(f"{name}.flatten", pool.out_shape)
    fc = Dense(f"{name}.fc", flat.out_shape, classes)
    return units + [pool, flat, fc]


def vgg(depth=16, batch=16, image=64, channels=3, classes=10, width=1):
    """VGG-depth (11/13/16/19, or 116/416 by repeating stage 3-5 convolutions); no batch norm."""
    if depth not in VGG_DEPTHS:
        raise ValueError(f"unknown VGG depth {depth}; valid depths: {', '.join(map(str, VGG_DEPTHS))}")
    shape = (batch, channels, image, image)
    units = []
    first = True
    for stage, (n, c) in enumerate(zip(_vgg_stages(depth), (64, 128, 256, 512, 512)), 1):
        for i in range(1, n + 1):
            conv = Conv2d(f"conv{stage}_{i}", shape, _ch(c, width), 3, 1, 1, bias=True, need_dx=not first)
            first = False
            units += [conv, ReLU(f"relu{stage}_{i}", conv.out_shape)]
            shape = conv.out_shape
        if shape[2] >= 2 and shape[3] >= 2:      # small test images stop pooling at 1x1
            pool = MaxPool2d(f"pool{stage}", shape, 2, 2)
            units.append(pool)
            shape = pool.out_shape
    flat = Flatten("flatten", shape)
    units.append(flat)
    shape = flat.out_shape
    hidden = _ch(4096, width)
    for i in (1, 2):
        fc = Dense(f"fc{i}", shape, hidden)
        units += [fc, ReLU(f"fc{i}.relu", fc.out_shape)]
        shape = fc.out_shape
    units.append(Dense("fc3", shape, classes))
    return Model(f"vgg{depth}", units, (batch, channels, image, image), classes)


def _stem(shape, width, pool_pad=1):
    conv = Conv2d("stem.conv", shape, _ch(64, width), 7, 2, 3, need_dx=False)
    bn = BatchNorm2d("stem.bn", conv.out_shape)
    relu = ReLU("stem.relu", conv.out_shape)
    pool = MaxPool2d("stem.pool", conv.out_shape, 3, 2, pool_pad)
    return [conv, bn, relu, pool], pool.out_shape


def resnet(depth=50, batch=16, image=64, channels=3, classes=10, width=1):
    """ResNet-depth: basic blocks for 18/34, bottleneck blocks for 50/101/152/200."""
    if depth not in RESNET_DEPTHS:
        raise ValueError(f"unknown ResNet depth {depth}; valid depths: "
                         f"{', '.join(map(str, RESNET_DEPTHS))}")
    kind, counts = RESNET_DEPTHS[depth]
    units, shape = _stem((batch, channels, image, image), width)
    for stage, (n, planes) in enumerate(zip(counts, (64, 128, 256, 512)), 1):
        for i in range(n):
            stride = 2 if (i == 0 and stage > 1) else 1
            block = ResidualBlock(f"layer{stage}.{i}", shape, _ch(planes, width), stride,
                                  kind == "bottleneck")
            units.append(block)
            shape = block.out_shape
    units += _head("head", shape, classes, width)
    return Model(f"resnet{depth}", units, (batch, channels, image, image), classes)


def densenet(depth=121, batch=16, image=64, channels=3, classes=10, width=1, growth=32):
    """DenseNet-BC-depth (121/169/201/264): growth 32, bottleneck 4k, compression 0.5."""
    if depth not in DENSENET_DEPTHS:
        raise ValueError(f"unknown DenseNet depth {depth}; valid depths: "
                         f"{', '.join(map(str, DENSENET_DEPTHS))}")
    k = _ch(growth, width)
    units, shape = _stem((batch, channels, image, image), width)
    blocks = DENSENET_DEPTHS[depth]
    for b, n in enumerate(blocks, 1):
        final = shape[1] + n * k          # one buffer per block (concatenation in place)
        for i in range(1, n + 1):
            layer = DenseLayer(f"dense{b}.{i}", shape, k, block_channels=final, first=i == 1)
            units.append(layer)
            shape = layer.out_shape
        if b < len(blocks):
            name = f"transition{b}"
            bn = BatchNorm2d(f"{name}.bn", shape)
            relu = ReLU(f"{name}.relu", shape)
            conv = Conv2d(f"{name}.conv", shape, max(1, shape[1] // 2), 1)
            layers = [bn, relu, conv]
            if conv.out_shape[2] >= 2 and conv.out_shape[3] >= 2:
                layers.append(AvgPool2d(f"{name}.pool", conv.out_shape, 2, 2))
            units.append(Chain(name, layers))
            shape = units[-1].out_shape
    units += _head("head", shape, classes, width, with_bn_relu=True)
    return Model(f"densenet{depth}", units, (batch, channels, image, image), classes)


MODELS = {"vgg": (vgg, VGG_DEPTHS), "resnet": (resnet, tuple(RESNET_DEPTHS)),
          "densenet": (densenet, tuple(DENSENET_DEPTHS))}


def build(model, depth, batch=16, image=64, channels=3, classes=10, width=1):
    """Build (without allocating) the named model; unknown names and depths list the valid ones."""
    try:
        fn, depths = MODELS[model]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {model!r}; valid models: {', '.join(MODELS)}") from None
    if depth not in depths:
        raise ValueError(f"unknown {model} depth {depth!r}; valid depths: "
                         f"{', '.join(map(str, depths))}")
    for label, v in (("batch", batch), ("image", image), ("channels", channels), ("classes", classes)):
        if not _is_count(v):
            raise ValueError(f"{model}{depth}: {label} must be >= 1 and a whole number, got {v!r}")
    if not _is_real(width) or not 0 < width < math.inf:
        raise ValueError(f"{model}{depth}: width divisor must be a finite number > 0, got "
                         f"{width!r}; width=1 is the full-size model")
    return fn(depth, int(batch), int(image), int(channels), int(classes), width)


def _is_real(v):
    """True for a real number that is not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _is_count(v):
    """True for a whole number >= 1 (an int, or a float without a fraction), not a bool."""
    return _is_real(v) and math.isfinite(v) and v >= 1 and int(v) == v


def _free_all(things, keep):
    """Free every array reachable from things except the objects in keep (end of iteration)."""
    def free(a):
        obj = a.object
        if obj.id not in keep and not obj.freed and not a.manager.pinned(obj):
            ca.unsafe_free(a)
    ca.onobjects(free, things)


def train_step(s, model, x, labels, optimizer, defrag=True, fused=True):
    """One annotated SGD step on (x, labels); returns the loss.

    After the step every temporary (gradients included) is freed and the fast heap defragmented
    (§4.6), leaving only the weights. Without the cleanup switch nothing is freed before that point, as with
    a garbage collector that runs once per iteration.

    fused: apply each parameter's update inside the backward pass, right after its gradient (and
    the data gradient that needs the old weights) is computed, and free the gradient at once, so
    gradients never outlive their layer; bitwise the same weights as ``fused=False``, which
    applies every update after the backward pass (as the optimizer step usually is).

    The iteration ends with a step mark (``ca.mark_step``): a trace of N iterations has N steps.

    Refused before any weight changes: a model not initialised or initialised on another
    manager, images that are not real numbers or hold NaN or inf, labels that are not class
    indices of the model, an optimizer without ``update``/``step``, a loss that is NaN or inf
    (``FloatingPointError``), and a second step on the same model or session while one runs.
    """
    defrag = check_switch(defrag, "train_step: defrag")
    fused = check_switch(fused, "train_step: fused")
    _check_model(s, model)
    _check_optimizer(optimizer, fused)
    x = _cached_input(x, "images x", s, s.dtype) if isinstance(x, ca.CachedArray) else \
        _images(x, s)
    if isinstance(labels, ca.CachedArray):
        _cached_input(labels, "labels", s)
    else:
        labels = _labels(labels, model)
    with _training(s, model):
        return _step(s, model, x, labels, optimizer, defrag, fused)


_TRAINING = set()                       # ids of the sessions and models in a training step
_TRAINING_LOCK = threading.Lock()


@contextlib.contextmanager
def _training(s, model):
    """Mark s and model as in a training step; refuse a second step on either meanwhile."""
    keys = (id(s), id(model))
    with _TRAINING_LOCK:
        if not _TRAINING.isdisjoint(keys):
            raise RuntimeError(
                f"train_step: model {model.name} or its session is already in a training step "
                "(in another thread, or train_step called from inside one); a model and a "
                "session run one step at a time: give each thread its own model and session")
        _TRAINING.update(keys)
    try:
        yield
    finally:
        with _TRAINING_LOCK:
            _TRAINING.difference_update(keys)


def _check_model(s, model):
    """Raise naming the problem when model cannot train in session s."""
    params = model.params()
    if sum(p.value.size for p in params) != model.param_count():
        raise RuntimeError(f"train_step: model {model.name} has no parameters yet; call "
                           "model.init(session, seed) before training it")
    if params and params[0].value.manager is not s.m:
        raise ValueError(f"train_step: the parameters of model {model.name} belong to another "
                         "manager than the session's; train it with the session it was "
                         "initialised with, or call model.init(session) with this one")
    if params and params[0].value.dtype != s.dtype:
        raise ValueError(f"train_step: the parameters of model {model.name} are "
                         f"{params[0].value.dtype}, the session computes in {s.dtype}; "
                         "initialise the model with this session (model.init(session))")


def _check_optimizer(optimizer, fused):
    """Raise TypeError unless optimizer has the method train_step calls."""
    need = "update" if fused else "step"
    if not callable(getattr(optimizer, need, None)):
        raise TypeError(f"train_step: optimizer must have the {need}() method of an optimizer "
                        f"such as cnn.SGD(0.01); got {type(optimizer).__name__}")


def _cached_input(a, what, s, dtype=None):
    """a, a CachedArray, refused unless on the session's manager (and of dtype, if given);
    its values are checked by the kernels that read it."""
    if a.manager is not s.m:
        raise ValueError(f"train_step: {what} are a CachedArray of another manager than the "
                         "session's; pass an ndarray, or ca.asarray(x, manager=session.m)")
    if dtype is not None and a.dtype != dtype:
        raise ValueError(f"train_step: {what} are {a.dtype}, the session computes in "
                         f"{dtype}; pass x.astype(np.{dtype}) or an ndarray")
    return a


def _images(x, s):
    """x as a C-contiguous ndarray of the session's dtype, refused unless real and finite."""
    a = np.asarray(x)
    if a.dtype.kind not in "biuf":
        raise TypeError(f"train_step: images x must be real numbers, got dtype {a.dtype}; "
                        "pass an ndarray of shape (N, C, H, W) (np.real(x) for complex data)")
    with np.errstate(over="ignore", invalid="ignore"):
        a = np.ascontiguousarray(a, dtype=s.dtype)
    bad = a.size - np.count_nonzero(np.isfinite(a))
    if bad:
        raise ValueError(f"train_step: images x have {bad} NaN or infinite values (in "
                         f"{s.dtype}); they would turn every weight into NaN: clean or clip "
                         "the data (np.nan_to_num) first")
    return a


def _labels(labels, model):
    """labels as a C-contiguous int64 ndarray, refused unless they are class indices of model."""
    a = np.asarray(labels)
    if a.dtype.kind not in "iu":
        raise ValueError(f"train_step: labels must be integer class indices, got dtype "
                         f"{a.dtype}; pass them as integers (e.g. labels.astype(np.int64), "
                         "after rounding)")
    n = model.input_shape[0]
    if a.shape != (n,):
        raise ValueError(f"train_step: labels have shape {a.shape}, but model {model.name} "
                         f"takes batches of {n} images: give one class index per image, "
                         f"shape ({n},)")
    out = (a < 0) | (a >= model.classes)
    if out.any():
        i = int(np.argmax(out))
        raise ValueError(f"train_step: label {a[i]} at position {i} is not a class of model "
                         f"{model.name}; labels must lie in [0, {model.classes})")
    return np.ascontiguousarray(a, dtype=np.int64)


def _check_loss(loss, model):
    """Raise FloatingPointError for a NaN or infinite loss (before any weight changes)."""
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"train_step: the loss of model {model.name} is {loss} (its forward pass met NaN or "
            "inf); the weights were left as they were: check the weights and the data for "
            "NaN or inf, or lower the learning rate that made them diverge")


def _step(s, model, x, labels, optimizer, defrag, fused):
    """train_step's work on checked inputs (x, labels: ndarrays or CachedArrays)."""
    m = s.m
    own = []
    if not isinstance(x, ca.CachedArray):
        x = ca.asarray(x, manager=m)
        own.append(x)
    if not isinstance(labels, ca.CachedArray):
        labels = ca.asarray(labels, manager=m)
        own.append(labels)
    tape, grads, logits = [], [], None
    try:
        logits = model.forward(s, x, tape)
        loss, g = softmax_cross_entropy(s, logits, labels)
        grads.append(g)
        _check_loss(loss, model)
        del g
        s.fused = optimizer if fused else None
        if s.frees_early:
            # Each gradient goes straight to the pullback that consumes it and each pullback is
            # dropped once it ran: a pullback's cleanup frees only what nothing else refers to.
            while tape:
                pb = tape.pop()
                grads.append(pb(grads.pop()))
            pb = None
        else:
            # As with a garbage collector that runs once per iteration: keep everything.
            for pb in reversed(tape):
                grads.append(pb(grads[-1]))
        s.fused = None
        if not fused:
            optimizer.step(s, model.params())
    finally:
        s.fused = None
        params = model.params()
        for p in params:
            p.drop_grad()
        keep = ca.preserve(params, [a for a in (x, labels) if not any(a is o for o in own)])
        _free_all((tape, grads, own, logits), keep)
        tape.clear()
        grads.clear()
        if defrag:
            m.defrag("fast")
    ca.mark_step(m)
    return loss
