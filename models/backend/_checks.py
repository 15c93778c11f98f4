"""Shape, dtype and layout checks shared by every compute backend.

Each check raises ``ValueError`` whose message starts with the operation name, lists the
offending shapes and says what was expected, so both backends fail identically.
"""

from __future__ import annotations

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


#: Geometry values (stride, pad, kernel) and channel offsets stay below this: oneDNN takes
#: them as int64 and multiplies them with sizes, and no real layer comes near it.
GEOMETRY_LIMIT = 1 << 31


def whole(value, what: str, op: str, low: int = 0) -> int:
    """A whole number (int or NumPy integer, not a bool) in [low, GEOMETRY_LIMIT), as an int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{op}: {what} must be a whole number (an int), got {value!r}; "
                         "floats, bools and strings are not rounded or parsed")
    if not low <= value < GEOMETRY_LIMIT:
        raise ValueError(f"{op}: {what} must lie in [{low}, 2**31), got {value}")
    return int(value)


def pair(value, what: str, op: str, low: int = 0) -> tuple[int, int]:
    """Normalise an int or a 2-sequence (height, width) of ints to a pair of ints >= low."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        return whole(value, what, op, low), whole(value, what, op, low)
    if len(value) != 2:
        raise ValueError(f"{op}: {what} must be an int or a pair of ints (height, width), got {value!r}")
    return whole(value[0], what, op, low), whole(value[1], what, op, low)


def window_output_size(size: int, kernel: int, stride: int, pad: int) -> int:
    """Output length of a sliding window with symmetric padding (floor rounding)."""
    return (size + 2 * pad - kernel) // stride + 1


def conv2d_output_shape(x_shape, w_shape, stride=1, pad=0, op="conv2d_output_shape"):
    """(N, K, P, Q) produced by a convolution of x (N,C,H,W) with w (K,C,R,S)."""
    if len(x_shape) != 4 or len(w_shape) != 4:
        raise ValueError(f"{op}: x must be (N,C,H,W) and w (K,C,R,S); got x {tuple(x_shape)}, w {tuple(w_shape)}")
    n, c, h, w = (int(v) for v in x_shape)
    k, c2, r, s = (int(v) for v in w_shape)
    sh, sw = pair(stride, "stride", op, 1)
    ph, pw = pair(pad, "pad", op)
    if min(k, c2, r, s) < 1:
        raise ValueError(f"{op}: w {tuple(w_shape)} has a zero dimension; a convolution needs at "
                         "least one input and output channel and a kernel of at least 1x1")
    if c != c2:
        raise ValueError(f"{op}: channel mismatch: x {tuple(x_shape)} has C={c} but w {tuple(w_shape)} has C={c2}")
    if h + 2 * ph < r or w + 2 * pw < s:
        raise ValueError(f"{op}: kernel {(r, s)} larger than padded input {(h + 2 * ph, w + 2 * pw)} (x {tuple(x_shape)}, pad {(ph, pw)})")
    return (n, k, window_output_size(h, r, sh, ph), window_output_size(w, s, sw, pw))


def pool_output_shape(x_shape, kernel, stride, pad, op="pool_output_shape"):
    """(N, C, P, Q) produced by pooling x (N,C,H,W)."""
    if len(x_shape) != 4:
        raise ValueError(f"{op}: x must be (N,C,H,W), got {tuple(x_shape)}")
    n, c, h, w = (int(v) for v in x_shape)
    kh, kw = pair(kernel, "kernel", op, 1)
    sh, sw = pair(stride, "stride", op, 1)
    ph, pw = pair(pad, "pad", op)
    if not (ph < kh and pw < kw):                 # pair() held them to >= 1 and >= 0
        raise ValueError(f"{op}: pad {(ph, pw)} must be >= 0 and smaller than kernel {(kh, kw)}")
    if h + 2 * ph < kh or w + 2 * pw < kw:
        raise ValueError(f"{op}: kernel {(kh, kw)} larger than padded input {(h + 2 * ph, w + 2 * pw)} (x {tuple(x_shape)})")
    return (n, c, window_output_size(h, kh, sh, ph), window_output_size(w, kw, sw, pw))


def array(op: str, name: str, a, shape=None, ndim=None, dtypes=FLOAT_DTYPES, contiguous=False, writable=False):
    """Check one argument: an ndarray of the given shape/ndim/dtype (and layout, for native code)."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{op}: {name} must be a numpy.ndarray, got {type(a).__name__}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimensions, got shape {a.shape}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} has shape {a.shape}, expected {tuple(shape)}")
    if dtypes is not None and a.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{op}: {name} has dtype {a.dtype}, expected {names}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{op}: {name} (shape {a.shape}) must be C-contiguous; pass np.ascontiguousarray({name})")
    if writable and not a.flags.writeable:
        raise ValueError(f"{op}: output {name} (shape {a.shape}) is read-only; pass a writable array")
    return a


def same_dtype(op: str, **arrays):
    """All given arrays (None skipped) share one dtype; returns it."""
    present = {k: v for k, v in arrays.items() if v is not None}
    dtypes = {v.dtype for v in present.values()}
    if len(dtypes) > 1:
        desc = ", ".join(f"{k} {v.dtype}" for k, v in present.items())
        raise ValueError(f"{op}: arrays must share one float dtype, got {desc}")
    return dtypes.pop() if dtypes else None


# --- per-operation argument checks (return the normalised geometry) -------------------------

def check_conv_forward(op, x, w, b, stride, pad, out, **kw):
    array(op, "x", x, ndim=4, **kw)
    array(op, "w", w, ndim=4, **kw)
    oshape = conv2d_output_shape(x.shape, w.shape, stride, pad, op)
    if b is not None:
        array(op, "b", b, shape=(w.shape[0],), **kw)
    array(op, "out", out, shape=oshape, writable=True, **kw)
    same_dtype(op, x=x, w=w, b=b, out=out)
    return oshape


def check_conv_backward_data(op, dy, w, stride, pad, dx, **kw):
    array(op, "dy", dy, ndim=4, **kw)
    array(op, "w", w, ndim=4, **kw)
    array(op, "dx", dx, ndim=4, writable=True, **kw)
    oshape = conv2d_output_shape(dx.shape, w.shape, stride, pad, op)
    if tuple(dy.shape) != oshape:
        raise ValueError(f"{op}: dy has shape {dy.shape}, expected {oshape} for dx {dx.shape}, w {w.shape}")
    same_dtype(op, dy=dy, w=w, dx=dx)
    return oshape


def check_conv_backward_weights(op, x, dy, stride, pad, dw, db, **kw):
    array(op, "x", x, ndim=4, **kw)
    array(op, "dy", dy, ndim=4, **kw)
    array(op, "dw", dw, ndim=4, writable=True, **kw)
    oshape = conv2d_output_shape(x.shape, dw.shape, stride, pad, op)
    if tuple(dy.shape) != oshape:
        raise ValueError(f"{op}: dy has shape {dy.shape}, expected {oshape} for x {x.shape}, dw {dw.shape}")
    if db is not None:
        array(op, "db", db, shape=(dw.shape[0],), writable=True, **kw)
    same_dtype(op, x=x, dy=dy, dw=dw, db=db)
    return oshape


def check_pool_forward(op, x, kernel, stride, pad, out, **kw):
    array(op, "x", x, ndim=4, **kw)
    oshape = pool_output_shape(x.shape, kernel, stride, pad, op)
    array(op, "out", out, shape=oshape, writable=True, **kw)
    same_dtype(op, x=x, out=out)
    separate(op, "out", out, x=x)
    return oshape


def check_pool_backward(op, dy, kernel, stride, pad, dx, x=None, **kw):
    array(op, "dx", dx, ndim=4, writable=True, **kw)
    if x is not None:
        array(op, "x", x, shape=dx.shape, **kw)
    oshape = pool_output_shape(dx.shape, kernel, stride, pad, op)
    array(op, "dy", dy, shape=oshape, **kw)
    same_dtype(op, dy=dy, dx=dx, x=x)
    return oshape


def separate(op, out_name, out, **inputs):
    """out shares no memory with any input (oneDNN's pooling reads windows it has already
    overwritten when computing in place, a silently wrong result)."""
    for name, a in inputs.items():
        if a is not None and np.may_share_memory(out, a):
            raise ValueError(f"{op}: output {out_name} {out.shape} overlaps input {name} "
                             f"{a.shape}; pass a separate output array")


def check_eps(op, eps):
    """A batch norm's epsilon: a finite real number > 0 (NaN or < 0 gives NaN outputs)."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer, np.floating)) \
            or not 0 < eps < float("inf"):
        raise ValueError(f"{op}: eps {eps!r} must be a finite number > 0, e.g. 1e-5")
    return float(eps)


def check_batch_stats(op, x):
    """Training batch norm needs at least one value per channel: the statistics of an empty
    batch are undefined (NaN)."""
    if 0 in x.shape:
        raise ValueError(f"{op}: x {x.shape} is empty; batch statistics need N, C, H and W >= 1")


def check_channels(op, x, names_arrays, **kw):
    """Per-channel vectors (C,) matching x (N,C,H,W)."""
    array(op, "x", x, ndim=4, **kw)
    c = x.shape[1]
    for name, a, is_out in names_arrays:
        array(op, name, a, shape=(c,), writable=is_out, **kw)


def check_same_shape(op, ref_name, ref, others, **kw):
    array(op, ref_name, ref, **kw)
    for name, a, is_out in others:
        array(op, name, a, shape=ref.shape, writable=is_out, **kw)
    same_dtype(op, **{ref_name: ref}, **{n: a for n, a, _ in others})


def check_dense_forward(op, x, w, b, out, **kw):
    array(op, "x", x, ndim=2, **kw)
    array(op, "w", w, ndim=2, **kw)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: x {x.shape} has {x.shape[1]} features but w {w.shape} expects {w.shape[1]} (w is (O,I))")
    if b is not None:
        array(op, "b", b, shape=(w.shape[0],), **kw)
    array(op, "out", out, shape=(x.shape[0], w.shape[0]), writable=True, **kw)
    same_dtype(op, x=x, w=w, b=b, out=out)


def check_relu_backward_bias(op, dy, y, dx, db, **kw):
    array(op, "dy", dy, ndim=2, **kw)
    check_same_shape(op, "dy", dy, [("y", y, False), ("dx", dx, True)], **kw)
    array(op, "db", db, shape=(dy.shape[1],), writable=True, **kw)
    same_dtype(op, dy=dy, db=db)


def check_dense_backward_data(op, dy, w, dx, **kw):
    array(op, "dy", dy, ndim=2, **kw)
    array(op, "w", w, ndim=2, **kw)
    if dy.shape[1] != w.shape[0]:
        raise ValueError(f"{op}: dy {dy.shape} has {dy.shape[1]} outputs but w {w.shape} has O={w.shape[0]}")
    array(op, "dx", dx, shape=(dy.shape[0], w.shape[1]), writable=True, **kw)
    same_dtype(op, dy=dy, w=w, dx=dx)


def check_dense_backward_weights(op, x, dy, dw, db, **kw):
    array(op, "x", x, ndim=2, **kw)
    array(op, "dy", dy, ndim=2, **kw)
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"{op}: batch mismatch: x {x.shape} vs dy {dy.shape}")
    array(op, "dw", dw, shape=(dy.shape[1], x.shape[1]), writable=True, **kw)
    if db is not None:
        array(op, "db", db, shape=(dy.shape[1],), writable=True, **kw)
    same_dtype(op, x=x, dy=dy, dw=dw, db=db)


def check_concat(op, xs, out, **kw):
    if len(xs) == 0:
        raise ValueError(f"{op}: need at least one input")
    array(op, "out", out, ndim=4, writable=True, **kw)
    total = 0
    for i, a in enumerate(xs):
        array(op, f"xs[{i}]", a, ndim=4, **kw)
        if a.shape[0] != out.shape[0] or a.shape[2:] != out.shape[2:]:
            raise ValueError(f"{op}: xs[{i}] has shape {a.shape}, incompatible with out {out.shape} (N,H,W must match)")
        total += a.shape[1]
    if total != out.shape[1]:
        shapes = [a.shape for a in xs]
        raise ValueError(f"{op}: channels of {shapes} sum to {total}, but out {out.shape} has {out.shape[1]}")
    same_dtype(op, out=out, **{f"xs{i}": a for i, a in enumerate(xs)})


def check_split(op, dy, sizes, outs, **kw):
    array(op, "dy", dy, ndim=4, **kw)
    sizes = [whole(s, f"sizes[{i}]", op) for i, s in enumerate(sizes)]
    if len(sizes) != len(outs) or sum(sizes) != dy.shape[1]:
        raise ValueError(f"{op}: sizes {sizes} must have one entry per output ({len(outs)}) and sum to dy channels {dy.shape[1]} (dy {dy.shape})")
    for i, (s, o) in enumerate(zip(sizes, outs)):
        array(op, f"outs[{i}]", o, shape=(dy.shape[0], s) + dy.shape[2:], writable=True, **kw)
    same_dtype(op, dy=dy, **{f"outs{i}": a for i, a in enumerate(outs)})
    return sizes


def check_softmax_ce(op, logits, labels, dlogits_out, **kw):
    array(op, "logits", logits, ndim=2, **kw)
    if 0 in logits.shape:
        raise ValueError(f"{op}: logits {logits.shape} must have at least one row (sample) and "
                         "one column (class): the mean loss of an empty batch is undefined")
    array(op, "labels", labels, shape=(logits.shape[0],), dtypes=None)
    if labels.dtype.kind not in "iu":
        raise ValueError(f"{op}: labels must be integer class indices (int64), got dtype {labels.dtype}")
    if labels.size and (labels.min() < 0 or labels.max() >= logits.shape[1]):
        raise ValueError(f"{op}: labels must lie in [0, {logits.shape[1]}) for logits {logits.shape}, got range [{labels.min()}, {labels.max()}]")
    if dlogits_out is not None:
        array(op, "dlogits_out", dlogits_out, shape=logits.shape, writable=True, **kw)
        same_dtype(op, logits=logits, dlogits_out=dlogits_out)


def check_slice(op, x, start, out, **kw):
    """out (N, C, H, W) receives channels start..start+C of x (N, >= start+C, H, W)."""
    array(op, "x", x, ndim=4, **kw)
    array(op, "out", out, ndim=4, writable=True, **kw)
    start = whole(start, "start", op)
    n, c = out.shape[:2]
    if start < 0 or x.shape[0] != n or x.shape[2:] != out.shape[2:] or x.shape[1] < start + c:
        raise ValueError(f"{op}: out {out.shape} must be channels {start}..{start + c} of x "
                         f"{x.shape} (same N, H, W)")
    same_dtype(op, x=x, out=out)
    return start


def check_place(op, x, start, out, **kw):
    """x (N, C, H, W) is written to channels start..start+C of out (N, >= start+C, H, W)."""
    array(op, "x", x, ndim=4, **kw)
    array(op, "out", out, ndim=4, writable=True, **kw)
    start = whole(start, "start", op)
    n, c = x.shape[:2]
    if start < 0 or out.shape[0] != n or out.shape[2:] != x.shape[2:] or out.shape[1] < start + c:
        raise ValueError(f"{op}: x {x.shape} must fit channels {start}..{start + c} of out "
                         f"{out.shape} (same N, H, W)")
    same_dtype(op, x=x, out=out)
    return start


def check_acc(op, acc, dx, **kw):
    """acc (N, >= C, H, W), whose first C channels are added to dx (N, C, H, W)."""
    array(op, "acc", acc, ndim=4, **kw)
    if (acc.shape[0] != dx.shape[0] or acc.shape[2:] != dx.shape[2:]
            or acc.shape[1] < dx.shape[1]):
        raise ValueError(f"{op}: acc {acc.shape} must hold at least the {dx.shape[1]} channels "
                         f"of dx {dx.shape} (same N, H, W)")
    same_dtype(op, acc=acc, dx=dx)


def check_lr(op, lr):
    """A learning rate: a finite real number >= 0 (NaN, inf or < 0 would ruin the weights)."""
    if isinstance(lr, (bool, np.bool_)) or not isinstance(lr, (int, float, np.integer, np.floating)) \
            or not 0 <= lr < float("inf"):
        raise ValueError(f"{op}: learning rate {lr!r} must be a finite number >= 0, e.g. 0.01")
