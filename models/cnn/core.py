"""Training machinery: a Session (manager, backend, annotations), Param, kernel calls, SGD.

Every kernel runs through ``Session.kernel``: it prefetches the kernel's arrays (forced), runs
the backend on plain ndarrays as one ``ca.compute(name, fn, reads, writes)`` kernel (a named
kernel in ``ca.trace`` traces, whose outputs a policy may drop and regenerate) and soft-evicts
the inputs (dissertation Listing 4.6).

Marks (what ``ca.trace`` records and policies' ``on_layer``/``on_step`` hooks see):
``Session.rrule`` marks a layer (``ca.mark_layer``) when a unit's forward has run and again when
its pullback has run (cleanup included). Models call ``rrule`` for their top-level units only
(a ResNet block, a DenseNet dense layer, a VGG conv/relu/pool layer), so one step of a model of
N units has 2N layer marks: mark l < N ends the forward of unit l, mark N + j ends the pullback
of unit N - 1 - j. ``train_step`` marks the step (``ca.mark_step``) at the end of each iteration.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

import cachedarrays as ca
from cachedarrays.copyengine import check_switch

from ..backend import get_backend

__all__ = ["Session", "Param", "SGD", "Unit"]

F32 = np.dtype(np.float32)


def _prefetch_matters(policy):
    """False when ca.prefetch can have no effect under policy (so Session.kernel skips it): its
    prefetch switch is off, or its prefetch never moves data and its read_use records nothing
    (ca.prefetch reports a read_use for an array already in fast memory). A policy that does
    not say (not a ca.policies.Policy) gets every annotation."""
    return getattr(policy, "allows_prefetch", True) and (
        getattr(policy, "honours_prefetch", True) or getattr(policy, "tracks_reads", True))


def _softevict_matters(policy):
    """False when ca.softevict is a no-op under policy (the base policy ignores it)."""
    return getattr(policy, "honours_softevict", True)


def _backend(backend):
    """The backend module for a name, or backend itself if it has the kernels."""
    if isinstance(backend, str):
        return get_backend(backend)
    if not all(callable(getattr(backend, k, None)) for k in ("conv2d_forward", "sgd_update")):
        raise TypeError(f"Session: backend must be a name ('numpy' or 'onednn') or a backend "
                        f"module, got {backend!r}")
    return backend


def _compute_dtype(dtype, be):
    """np.dtype(dtype), refused unless float32, or float64 on a backend other than oneDNN."""
    dt = np.dtype(dtype)
    allowed = (F32,) if getattr(be, "name", None) == "onednn" else (F32, np.dtype(np.float64))
    if dt not in allowed:
        raise ValueError(f"Session: dtype {dt} is not computed by the "
                         f"{getattr(be, 'name', '?')} backend; use "
                         f"{' or '.join(map(str, allowed))}")
    return dt


class Param:
    """A trainable tensor (a CachedArray) and its gradient of the current step (or None).

    Gradients are new arrays made by the backward pass (so they start in fast memory). With a
    fused optimizer (``Session.fused``) each is applied and freed inside the pullback that made
    it; otherwise it is freed after the optimizer step, or at the end of the iteration.
    """

    __slots__ = ("name", "value", "grad")

    def __init__(self, name, value, grad=None):
        self.name, self.value, self.grad = name, value, grad

    def new_grad(self, s):
        """Allocate this step's gradient array (uninitialised; the backward kernel writes it)."""
        self.grad = s.empty(self.value.shape)
        return self.grad

    def drop_grad(self):
        """Free the gradient array, if any."""
        g, self.grad = self.grad, None
        if g is not None and not g.is_freed and not g.manager.pinned(g.object):
            ca.unsafe_free(g)

    def __repr__(self):
        return f"<Param {self.name} {self.value.shape}>"


@ca.register_leaf_type
class Session:
    """What the layers run with: the manager, the backend module and the annotation switch.

    ``annotations=False`` runs the same code without prefetch/softevict/cleanup/noescape calls
    (the layer marks are made either way). Record what runs with ``ca.trace(session.m)``.
    ``fused``: an optimizer applied to each parameter inside the backward pass, right after its
    gradient is computed (``train_step`` sets it for the duration of a fused step).
    """

    def __init__(self, manager, backend="numpy", annotations=True, dtype=F32):
        # The annotation walkers meet the session in every pullback closure; it holds no arrays
        # of its own, so it is registered as a leaf type and they never look inside it.
        if not isinstance(manager, ca.Manager):
            raise TypeError(f"Session: manager must be a ca.Manager, got "
                            f"{type(manager).__name__}; e.g. Session(ca.Manager(fast=..., "
                            "slow=...), 'numpy')")
        self.m = manager
        self.be = _backend(backend)
        self.annotations = check_switch(annotations, "Session: annotations")
        self.dtype = _compute_dtype(dtype, self.be)
        self.fused = None
        # Skip annotation walks that cannot do anything under this policy (the results are the
        # same: the calls would be no-ops). LRU in setups L/LM (prefetch switch off) never moves
        # an array on prefetch; the policies that never move data (FastOnly, SlowOnly,
        # FirstTouch) declare that their prefetch moves nothing, their read_use records
        # nothing and their softevict is ignored (see the capabilities in ca.policies.Policy).
        self._prefetches = _prefetch_matters(manager.policy)
        self._softevicts = _softevict_matters(manager.policy)

    # ---- allocation ----------------------------------------------------------------------

    def empty(self, shape, dtype=None):
        """A new array of the session's dtype (float32 unless set; float64 for exact gradient
        checks with the NumPy backend), placed by the policy."""
        return ca.empty(shape, dtype=self.dtype if dtype is None else dtype, manager=self.m)

    def param(self, name, data):
        """A Param holding a copy of ndarray data (in the session's dtype)."""
        return Param(name, ca.asarray(np.ascontiguousarray(data, dtype=self.dtype), manager=self.m))

    @property
    def frees_early(self):
        """True when annotations are on and the policy's cleanup switch allows eager frees."""
        return self.annotations and getattr(self.m.policy, "allows_cleanup", True)

    def release(self, *arrays):
        """Free arrays whose last use has run (a layer's saved state after its pullback), when the
        memory optimisations are on; None, freed and pinned arrays are skipped. Pass base arrays
        only: freeing a view frees the storage it shares."""
        if not self.frees_early:
            return
        live = [a for a in arrays
                if a is not None and not a.is_freed and not a.manager.pinned(a.object)]
        if live:
            ca.unsafe_free(*live)

    def grads_ready(self, *params):
        """Called by a pullback once these parameters' gradients are written and nothing else in
        the pullback reads their old values. With a fused optimizer, apply each update now and
        free the gradient (when frees_early; else it lives until the end of the iteration)."""
        opt = self.fused
        if opt is None:
            return
        for p in params:
            if p is not None:
                opt.update(self, p)

    # ---- kernels -------------------------------------------------------------------------

    def kernel(self, name, fn, reads, writes, pure=True):
        """Run fn(*read_views, *write_views) on pinned ndarray views; None entries pass through.

        One kernel named ``name`` in traces, with these read and write sets: ``ca.compute``
        (its outputs can be dropped and regenerated), or ``ca.kernel`` when pure is False (fn
        also depends on the old contents of a write it does not list as read, as SGD's update
        of a weight does). An array may appear in both reads and writes (an in-place kernel);
        it is pinned twice.
        """
        ann = self.annotations
        if ann and self._prefetches:
            ca.prefetch(reads, writes, force=True)
        if pure:
            result = ca.compute(name, fn, reads, writes)
        else:
            with ca.kernel(name, reads, writes) as views:
                result = fn(*views)
        if ann and self._softevicts:
            ca.softevict(reads)
        return result

    # ---- annotation of units (Listing 4.6) --------------------------------------------------

    def rrule(self, unit, x):
        """Call unit.forward(self, x) -> (y, pullback) with the unit's memory annotations.

        The forward runs under ``noescape``; the returned pullback runs under ``noescape`` and
        afterwards frees what it captured, the output and dy (``cleanup``) except the unit's
        parameters, its input and its result, and except what anything else still refers to
        (a caller's ``y``). The policy's cleanup switch turns both off.

        A layer mark follows the forward and another the pullback (see the module docstring);
        without annotations too, so traces of both have the same layers.
        """
        m = self.m
        if not self.annotations:
            y, pullback = unit.forward(self, x)
            ca.mark_layer(m)

            def marked_pullback(dy):
                dx = pullback(dy)
                ca.mark_layer(m)
                return dx

            return y, marked_pullback
        # cleanup frees only what nothing outside its argument refers to, so the wrapper holds
        # the output and the pullback in this list alone and hands dy over to it as well.
        captured = list(ca.noescape(unit.forward)(self, x))
        ca.mark_layer(m)

        def pullback_wrapper(dy):
            # The unit's parameters (every array a Unit holds) are part of the result so that
            # their new gradients are not temporaries: for a Unit, the arrays of its Params,
            # listed (a list of arrays is not walked further); any other object is walked whole.
            params = unit.params() if isinstance(unit, Unit) else [unit]
            dx, _ = ca.noescape(lambda d: (captured[1](d), _arrays_of(params)))(dy)
            captured.append(dy)
            del dy
            try:
                ca.cleanup(captured, keep=ca.preserve(*_arrays_of(params, x, dx)))
            finally:
                del captured[2:]
            ca.mark_layer(m)
            return dx

        return captured[0], pullback_wrapper


def _arrays_of(params, *more):
    """The CachedArrays of params (each Param's value and gradient; any other object as it is,
    for the walkers to search) and more, None left out."""
    out = []
    for p in params:
        if type(p) is Param:
            out.append(p.value)
            if p.grad is not None:
                out.append(p.grad)
        else:
            out.append(p)
    out.extend(a for a in more if a is not None)
    return out


class Unit:
    """Base of layers and blocks: a name, the input and output shapes it was built for.

    Subclasses set ``in_shape``/``out_shape`` in __init__, allocate parameters in
    ``init(session, rng)`` and implement ``forward(session, x) -> (y, pullback)``.
    """

    name = "unit"
    in_shape: tuple = ()
    out_shape: tuple = ()

    def params(self):
        """Every Param of this unit (and its sub-units), in a fixed order."""
        out = []
        for v in self.__dict__.values():
            if isinstance(v, Param):
                out.append(v)
            elif isinstance(v, Unit):
                out.extend(v.params())
            elif isinstance(v, (list, tuple)):
                for u in v:
                    if isinstance(u, Unit):
                        out.extend(u.params())
        return out

    def sublayers(self):
        """Direct sub-units, in order."""
        out = []
        for v in self.__dict__.values():
            if isinstance(v, Unit):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(u for u in v if isinstance(u, Unit))
        return out

    def init(self, s, rng):
        """Allocate parameters (sub-units in order)."""
        for u in self.sublayers():
            u.init(s, rng)

    def param_count(self):
        """Number of parameter elements (from shapes; works before init)."""
        return sum(u.param_count() for u in self.sublayers())

    def activation_bytes(self):
        """Bytes of float32 outputs this unit produces in one forward (saved for backward)."""
        return sum(u.activation_bytes() for u in self.sublayers())

    def check_input(self, x):
        """Raise ValueError naming this unit if x does not have the shape it was built for."""
        if tuple(x.shape) != tuple(self.in_shape):
            raise ValueError(f"layer {self.name}: input has shape {tuple(x.shape)}, expected "
                             f"{tuple(self.in_shape)} (the shape the model was built for); build "
                             "the model with the batch, channels and image size you feed it")

    def __repr__(self):
        return f"<{type(self).__name__} {self.name} {self.in_shape}->{self.out_shape}>"


def _learning_rate(lr):
    """lr as a float, refused unless a finite number >= 0."""
    if isinstance(lr, (bool, np.bool_)) or not isinstance(lr, numbers.Real) or \
            not 0 <= lr < math.inf:
        raise ValueError(f"SGD: learning rate lr={lr!r} must be a finite number >= 0, "
                         "e.g. SGD(0.01); a negative, NaN or infinite rate ruins the weights")
    return float(lr)


class SGD:
    """Plain stochastic gradient descent: param -= lr * grad, one kernel per parameter.

    ``update`` applies one parameter's gradient (fused into the backward pass, or called by
    ``step`` after it). The update is elementwise and each weight is read by its own layer only,
    so applying it inside the pullback gives bitwise the same weights as applying it at the end.
    With the memory optimisations on, each gradient is freed as soon as it has been applied.
    """

    def __init__(self, lr=0.01):
        self.lr = lr

    @property
    def lr(self):
        """The learning rate (a finite float >= 0; checked when set)."""
        return self._lr

    @lr.setter
    def lr(self, value):
        self._lr = _learning_rate(value)

    def update(self, s, p):
        """param -= lr * grad for one Param; frees the gradient when s.frees_early."""
        if p.grad is None:
            raise ValueError(f"SGD: parameter {p.name} has no gradient; run the backward pass "
                             "(the model's pullbacks) before the optimizer step")
        lr, be = self.lr, s.be
        s.kernel("sgd_update", lambda g, w: be.sgd_update(w, g, lr), (p.grad,), (p.value,),
                 pure=False)
        if s.frees_early:
            p.drop_grad()
        if s.annotations and s._prefetches and s._softevicts:
            # Not needed again until this layer's next forward (which prefetches it back): let
            # saved activations, which the rest of the backward pass reads sooner, stay in fast
            # memory before it. Without prefetching, an evicted weight never returns to fast
            # memory, so there it stays where it is (measured: fewer slow writes both ways).
            ca.softevict(p.value)

    def step(self, s, params):
        """Apply every parameter's gradient (the unfused path)."""
        for p in params:
            self.update(s, p)
