"""Record a PyTorch training loop as a :class:`~cachedarrays.trace.Trace`.

``from_torch(model, inputs, loss_fn)`` runs a few training steps of a ``torch.nn.Module`` on the
CPU under a ``TorchDispatchMode`` and records every aten op as one kernel of the trace:

* objects are tensor *storages* (views share their storage, so a view is the same object);
  an object is allocated when first seen (before the kernel that first uses it) and freed when
  its storage dies. A sparse tensor is the storages of its index and value tensors (a sparse
  gradient ``grad:<param name>`` is ``grad:<param name>.indices`` and ``.values``), a jagged
  nested tensor (``layout=torch.jagged``) those of its values, offsets and lengths (an input
  ``input:<i>`` is ``input:<i>.values`` ...) and a strided nested tensor its one buffer;
* a kernel reads the storages of its tensor arguments and writes the storages of its new outputs
  and of the arguments it mutates (in-place and ``out=`` ops: schema ``alias_info.is_write``),
  which it also reads. An op that only makes views (``t``, ``view``, ``detach``, ``expand`` ...)
  touches no data: it is a kernel with no operands;
* a kernel's time is the op's wall time (``time.perf_counter`` around the call). The kernels of
  the steps that run the same ops as the last one (names in order; every step for a plain SGD
  step, all but the first when the optimizer makes its state in step 1) get, position by
  position, the median across those steps: meta["times"] = "median of N steps" and
  meta["timed_steps"] lists them (1-based); with fewer than two such steps times stay raw;
* ``profiler::`` ops (``record_function`` markers of the optimizers) are not kernels;
* object ids (``sid``) are stable across steps, so the consumer can take the last step as the
  steady state: ``param:<name>`` (parameters and buffers), ``input:<i>``, ``grad:<param name>``,
  ``state:<param name>.<key>`` (optimizer state), ``act:<op>#<n>`` (the n-th output storage
  made by that op in the step) and ``ext:<op>#<n>`` (storages from outside the step, such as a
  target captured by ``loss_fn``, named after the op that first read them). A name still taken
  by a live object (one made in an earlier step and kept, such as a hidden state carried
  into the next step) is given the step's number, ``@<step>`` (steps counted from 0), as
  ``StableIds`` does, so that the planning policies know it for the same object of another
  step; a name used before with another size gets a suffix ``~2``, ``~3``...;
* each step ends with a ``("step",)`` mark; forward hooks on the model's direct children add
  ``("layer",)`` marks at their boundaries (forward only: backward hooks would add ops and break
  in-place modules; TorchScript children take no hooks, so they make no marks).

Storages are identified by their Python object (torch keeps one per storage, weakref-able, and
its death callback emits the ``free``). Were they not weakref-able, objects would be keyed by
``(data_ptr, nbytes)`` and a free seen only when the memory is reused (meta["objects_by"] says
which); ids are then less stable.

Only the standard library and torch (imported lazily) are used; install torch with
``pip install "cachedarrays[peer]"``.
"""

import inspect
import operator
import statistics
import time
import weakref

from .trace import Trace

__all__ = ["from_torch"]

_INSTALL = 'from_torch needs PyTorch: pip install "cachedarrays[peer]"'

# aten ops that write an argument their schema does not mark as written: op -> argument positions.
# native_batch_norm updates running_mean and running_var in training mode (schema says read-only).
_UNANNOTATED_WRITES = {"aten::native_batch_norm": (3, 4)}

# The tensors holding a sparse tensor's data, by layout name: (role, method) pairs.
_COMPRESSED_ROWS = (("crow_indices", "crow_indices"), ("col_indices", "col_indices"),
                    ("values", "values"))
_COMPRESSED_COLUMNS = (("ccol_indices", "ccol_indices"), ("row_indices", "row_indices"),
                       ("values", "values"))
_SPARSE_PARTS = {"sparse_coo": (("indices", "_indices"), ("values", "_values")),
                 "sparse_csr": _COMPRESSED_ROWS, "sparse_bsr": _COMPRESSED_ROWS,
                 "sparse_csc": _COMPRESSED_COLUMNS, "sparse_bsc": _COMPRESSED_COLUMNS}


def _import_torch():
    try:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(_INSTALL) from e
    return torch, TorchDispatchMode


def _storages_are_stable(torch):
    """True if a storage's Python object lives as long as the storage (weakref-able, one object).

    torch >= 2.0 preserves it; otherwise objects are keyed by (data_ptr, nbytes) instead.
    """
    try:
        t = torch.empty(1)
        s = t.untyped_storage()
        ref = weakref.ref(s)
        del s
        return ref() is not None and t.untyped_storage() is ref()
    except TypeError:
        return False


class _Recorder:
    """The per-op bookkeeping. Events and kernels name objects by internal ids (ints) until
    :meth:`build` turns them into stable sids."""

    def __init__(self, torch, prenamed, weak):
        self.Tensor = torch.Tensor
        self.strided = torch.strided
        self.jagged = getattr(torch, "jagged", None)
        self.prenamed = prenamed      # storage key -> sid (parameters, buffers, inputs)
        self.weak = weak              # storages weakref-able (else keyed by data_ptr+nbytes)
        self.events = []              # as Trace events, with internal ids for sids
        self.kernels = []             # (name, reads, writes) with internal ids
        self.times = []
        self.base = []                # internal id -> base sid
        self.nbytes = []              # internal id -> nbytes
        self.live = {}                # storage key -> internal id (storages alive and seen)
        self.refs = {}                # storage key -> weakref (keeps the death callback alive)
        self.counters = {}            # "act:mm" -> ordinal within the current step
        self.info = {}                # OpOverload -> cached schema facts
        self.step_ranges = []         # (first kernel, end kernel) of each finished step
        self.step_start = 0
        self.marked = 0               # kernels recorded at the last layer or step mark
        self.closed = False
        self.paused = False           # ops of from_torch's own bookkeeping are not kernels

    # -- objects ------------------------------------------------------------------------------
    def _new(self, key, s, prefix, base=None):
        """Register a storage seen for the first time; returns its internal id."""
        iid = len(self.base)
        if base is None:
            base = self.prenamed.get(key)
        if base is None:
            n = self.counters.get(prefix, 0)
            self.counters[prefix] = n + 1
            base = f"{prefix}#{n}"
        nbytes = s.nbytes()
        self.base.append(base)
        self.nbytes.append(nbytes)
        self.live[key] = iid
        if self.weak:
            self.refs[key] = weakref.ref(s, self._died_callback(key, iid))
        self.events.append(("alloc", iid, nbytes, None))
        return iid

    def _died_callback(self, key, iid):
        def died(_ref, self=self, key=key, iid=iid):
            if self.closed:
                return
            self.refs.pop(key, None)
            if self.live.get(key) == iid:
                del self.live[key]
            self.events.append(("free", iid))
        return died

    def _sized(self, key, s, iid):
        """iid, or a new id if the storage's size changed since it was recorded (``resize_``,
        an ``out=`` that grew it): the old object is freed and the storage allocated anew at
        its size (its death then frees the new one only)."""
        if not self.weak or s.nbytes() == self.nbytes[iid]:
            return iid
        del self.live[key]
        self.events.append(("free", iid))
        return self._new(key, s, None, self.base[iid])

    def _free(self, key):
        """Fallback mode: the storage at key died (its memory now holds a new one)."""
        iid = self.live.pop(key)
        self.events.append(("free", iid))

    def _key(self, t):
        """(storage key, storage) of tensor t, or (None, None) if it has no data storage."""
        if t.layout is self.jagged:
            return None, None            # a wrapper: its parts hold the data (see parts)
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):   # sparse, nested, wrappers
            return None, None
        if self.weak:
            return id(s), s
        return (s.data_ptr(), s.nbytes()), s

    def _check(self, t, s):
        """Whether a storage seen for the first time is recordable (raises on a non-CPU one)."""
        if not t.is_cpu:
            if t.is_meta:
                return False
            raise ValueError(f"from_torch records CPU runs only, but an op used a tensor on "
                             f"{t.device}: move the model, the inputs and every tensor the loss "
                             f"uses to the CPU first (model.to('cpu'))")
        try:
            return s.data_ptr() != 0 or s.nbytes() == 0
        except RuntimeError as e:        # a wrapper subclass: its storage holds no data
            raise ValueError(
                f"from_torch records tensors that hold their data, but an op used a "
                f"{type(t).__name__} of shape {tuple(t.shape)} (layout {t.layout}) whose "
                f"storage holds none ({e}); pass plain, sparse or nested tensors") from None

    def parts(self, t):
        """(role, tensor) of the tensors holding a sparse or jagged nested tensor's data; []
        for a strided one (a strided nested tensor too: one buffer holds its data)."""
        if t.layout is self.strided:
            return []
        if t.layout is self.jagged:      # attributes, not ops: nothing is dispatched
            return [(role, part) for role, part in (("values", t._values),
                                                    ("offsets", t._offsets),
                                                    ("lengths", t._lengths))
                    if part is not None]
        names = _SPARSE_PARTS.get(str(t.layout).rpartition(".")[2], ())
        return [(role, getattr(t, method)()) for role, method in names]

    def _read_parts(self, t, ext, into):
        """Add the internal ids of a sparse tensor's storages to into."""
        for _, part in self.parts(t):
            iid = self.lookup(part, ext)
            if iid is not None:
                into[iid] = None

    def lookup(self, t, ext):
        """Internal id of an operand's storage; allocates it at first sight."""
        key, s = self._key(t)
        if key is None:
            return None
        iid = self.live.get(key)
        if iid is None:
            if self._check(t, s):
                iid = self._new(key, s, ext)
        else:
            iid = self._sized(key, s, iid)
        return iid

    # -- kernels ------------------------------------------------------------------------------
    def _op_info(self, func):
        if func.namespace == "profiler":
            self.info[func] = None
            return None
        schema = func._schema
        unannotated = _UNANNOTATED_WRITES.get(schema.name, ())
        written = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                        if (a.alias_info is not None and a.alias_info.is_write)
                        or i in unannotated)
        short = str(func.overloadpacket)
        if short.startswith("aten."):
            short = short[5:]
        # prim:: and sym_* ops (layout, sizes of a wrapper such as a jagged nested tensor)
        # read metadata only: like a view op, a kernel that touches no data
        metadata = func.namespace == "prim" or short.startswith("sym_")
        info = (str(func), f"act:{short}", f"ext:{short}", written, metadata)
        self.info[func] = info
        return info

    def _tensors(self, x, out):
        """Append the tensors in x (a tensor, or a list/tuple nesting tensors) to out."""
        if isinstance(x, self.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                self._tensors(y, out)

    def op(self, func, args, kwargs, result, seconds):
        info = self.info.get(func, False)
        if info is False:
            info = self._op_info(func)
        if info is None:
            return                       # profiler markers (record_function): not kernels
        name, act, ext, written, metadata = info
        if metadata:
            k = len(self.kernels)
            self.kernels.append((name, (), ()))
            self.times.append(seconds)
            self.events += (("kernel", k), ("end", k))
            return
        Tensor = self.Tensor
        reads = {}
        strided = self.strided
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, Tensor):
                iid = self.lookup(a, ext)
                if iid is not None:
                    reads[iid] = None
                elif a.layout is not strided:
                    self._read_parts(a, ext, reads)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, Tensor):
                        iid = self.lookup(b, ext)
                        if iid is not None:
                            reads[iid] = None
                        elif b.layout is not strided:
                            self._read_parts(b, ext, reads)
        writes = {}
        for i, argname in written:
            a = args[i] if i < len(args) else kwargs.get(argname)
            if a is None:
                continue
            ts = []
            self._tensors(a, ts)
            for t in ts:
                ids = {}
                if t.layout is strided:
                    ids[self.lookup(t, ext)] = None
                else:
                    self._read_parts(t, ext, ids)
                ids.pop(None, None)
                writes.update(ids)
                reads.update(ids)
        outs = []
        self._tensors(result, outs)
        for t in outs:              # a sparse output: its parts, appended to the list
            key, s = self._key(t)
            if key is None:
                outs += [part for _, part in self.parts(t)]
                continue
            iid = self.live.get(key)
            if iid is not None and self.weak:
                iid = self._sized(key, s, iid)
            if iid is not None and iid in reads:
                continue                 # an alias of an operand: written only if mutated
            if iid is not None and not self.weak:
                self._free(key)          # fallback: that memory now holds a new storage
                iid = None
            if iid is None:
                if not self._check(t, s):
                    continue
                iid = self._new(key, s, act)
            writes[iid] = None
        if outs and not writes:
            reads = {}                   # a view op (t, view, detach...): touches no data
        k = len(self.kernels)
        self.kernels.append((name, tuple(reads), tuple(writes)))
        self.times.append(seconds)
        self.events += (("kernel", k), ("end", k))

    # -- marks --------------------------------------------------------------------------------
    def layer(self, *_):
        """A forward hook of a direct child: a layer mark, unless no kernel ran since the last."""
        if len(self.kernels) > self.marked:
            self.marked = len(self.kernels)
            self.events.append(("layer",))

    def begin_step(self):
        self.counters.clear()
        self.step_start = self.marked = len(self.kernels)

    def end_step(self):
        self.step_ranges.append((self.step_start, len(self.kernels)))
        self.events.append(("step",))

    def iid_of(self, t):
        key, _ = self._key(t)
        return None if key is None else self.live.get(key)

    def named_parts(self, t, sid):
        """(tensor, sid) of t's storages: t itself, or a sparse tensor's parts (sid.role)."""
        self.paused = True
        try:
            parts = self.parts(t)
        finally:
            self.paused = False
        return [(part, f"{sid}.{role}") for role, part in parts] if parts else [(t, sid)]

    # -- result -------------------------------------------------------------------------------
    def median_times(self):
        """Kernel times, and how they were made (meta["times"], the steps used)."""
        times = list(self.times)
        names = [[self.kernels[k][0] for k in range(a, b)] for a, b in self.step_ranges]
        same = [i for i, n in enumerate(names) if n == names[-1]]
        if len(same) < 2:
            return times, "raw", []
        for j in range(len(names[-1])):
            m = statistics.median(self.times[self.step_ranges[i][0] + j] for i in same)
            for i in same:
                times[self.step_ranges[i][0] + j] = m
        return times, f"median of {len(same)} steps", [i + 1 for i in same]

    def build(self, overrides):
        """(objects, events, kernels) with stable sids: an id's base name, or its override;
        ``@<step>`` when that name is alive already (made in an earlier step), and a suffix
        ~2, ~3... when the name is still taken or was used with another size."""
        sid_of = {}
        objects = {}
        alive = set()
        events = []
        step = 0
        for ev in self.events:
            tag = ev[0]
            if tag == "alloc":
                iid, nbytes = ev[1], ev[2]
                base = overrides.get(iid) or self.base[iid]
                if base in alive:
                    base = f"{base}@{step}"
                sid, j = base, 1
                while sid in alive or objects.get(sid, nbytes) != nbytes:
                    j += 1
                    sid = f"{base}~{j}"
                alive.add(sid)
                objects.setdefault(sid, nbytes)
                sid_of[iid] = sid
                events.append(("alloc", sid, nbytes, None))
            elif tag == "free":
                sid = sid_of[ev[1]]
                alive.discard(sid)
                events.append(("free", sid))
            else:
                step += tag == "step"
                events.append(ev)
        kernels = [(name, tuple(sid_of[i] for i in r), tuple(sid_of[i] for i in w))
                   for name, r, w in self.kernels]
        return objects, events, kernels


def _is_fake(t):
    """True for a FakeTensor (shapes and dtypes only, no data)."""
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - depends on the torch version
        return False
    return is_fake(t)


def _required_args(optimizer):
    """The arguments the step of an optimizer's class cannot do without (LBFGS's closure), by
    name. The class's: an lr scheduler wraps the instance's step in one taking anything."""
    try:
        params = list(inspect.signature(type(optimizer).step).parameters.values())[1:]
    except (AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.kind not in
            (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _grads(params):
    """Each parameter's gradient and its version now (to see which ones a backward writes)."""
    return [None if p.grad is None else (p.grad, p.grad._version) for p in params]


def _wrote_a_grad(params, before):
    """True if one of params has a gradient it had not before, or one written since."""
    for p, was in zip(params, before):
        g = p.grad
        if g is not None and (was is None or g is not was[0] or g._version != was[1]):
            return True
    return False


def _mode_class(TorchDispatchMode):
    class _RecordMode(TorchDispatchMode):
        def __init__(self, recorder):
            super().__init__()
            self.recorder = recorder

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if self.recorder.paused:
                return func(*args, **kwargs)
            t0 = time.perf_counter()
            result = func(*args, **kwargs)
            seconds = time.perf_counter() - t0
            self.recorder.op(func, args, kwargs, result, seconds)
            return result

    return _RecordMode


def from_torch(model, inputs, loss_fn, *, steps=3, optimizer=None, name=None):
    """Run ``steps`` training steps of ``model`` on the CPU and return them as a Trace.

    model: a ``torch.nn.Module`` whose parameters and buffers are real tensors on the CPU (not
        meta, fake or uninitialized lazy ones).
    inputs: a tensor, or a tuple/list of positional arguments: the step calls ``model(*inputs)``.
    loss_fn: ``loss_fn(output) -> real scalar tensor`` (capture targets in a closure); its
        backward must give a parameter the optimizer trains a gradient (checked in step 1).
    steps: training steps to record (>= 1); each is forward, loss, backward, ``optimizer.step()``
        and ``zero_grad``, followed by a ("step",) mark. The consumer uses the last as steady state.
    optimizer: a ``torch.optim.Optimizer`` over the model's parameters whose ``step()`` needs
        no argument (not LBFGS, which needs a closure); default
        ``torch.optim.SGD(model.parameters(), lr=0.01)``. The model *is trained*: its parameters
        (and the optimizer's state) change as in a real run; pass ``copy.deepcopy(model)`` to
        keep the original.
    name: meta["model"], a str; default the model's class name.

    The model runs in training mode with gradients enabled; both flags are restored afterwards,
    also when a step raises (the exception propagates once recording has stopped).
    """
    torch, TorchDispatchMode = _import_torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"from_torch needs a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (output -> scalar tensor), "
                        f"got {type(loss_fn).__name__}")
    if isinstance(steps, bool):
        raise TypeError("steps must be an int >= 1, got a bool")
    try:
        steps = operator.index(steps)
    except TypeError:
        raise TypeError(f"steps must be an int >= 1, got {type(steps).__name__}") from None
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if isinstance(inputs, torch.Tensor):
        args = (inputs,)
    elif isinstance(inputs, (tuple, list)):
        args = tuple(inputs)
    else:
        raise TypeError(f"inputs must be a tensor or a tuple/list of model arguments, "
                        f"got {type(inputs).__name__}")

    tensors = [(f"param:{n}", f"parameter {n}", p) for n, p in model.named_parameters()]
    tensors += [(f"param:{n}", f"buffer {n}", b) for n, b in model.named_buffers()]
    tensors += [(f"input:{i}", f"input {i}", a) for i, a in enumerate(args)
                if isinstance(a, torch.Tensor)]
    for _, what, t in tensors:
        if torch.nn.parameter.is_lazy(t):
            raise ValueError(f"{what} is not initialized yet (a lazy module): call the model "
                             f"once on a batch before from_torch")
        if t.device.type != "cpu":
            raise ValueError(f"from_torch records CPU runs only, but {what} is on {t.device}: "
                             f"move the model and the inputs to the CPU first (model.to('cpu'))")
        if _is_fake(t):
            raise ValueError(f"from_torch records real runs, but {what} is a fake tensor "
                             f"(FakeTensorMode), which holds no data: make the model and the "
                             f"inputs outside FakeTensorMode")

    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str (meta['model'] of the trace) or None for the "
                        f"model's class name, not {type(name).__name__}")
    if optimizer is not None and not (isinstance(getattr(optimizer, "param_groups", None), list)
                                      and callable(getattr(optimizer, "step", None))
                                      and callable(getattr(optimizer, "zero_grad", None))):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer over the model's parameters "
                        f"(or None for SGD), not {type(optimizer).__name__}")
    needed = [] if optimizer is None else _required_args(optimizer)
    if needed:
        raise TypeError(f"{type(optimizer).__name__}.step needs an argument "
                        f"({', '.join(needed)}), and from_torch calls optimizer.step() with none "
                        f"after each forward and backward: use an optimizer whose step() takes "
                        f"no arguments (SGD, Adam...; not LBFGS, which needs a closure)")
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (none requires grad)")
        optimizer = torch.optim.SGD(params, lr=0.01)
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    param_names = {}
    for n, p in model.named_parameters():
        param_names.setdefault(p, n)
    for group in optimizer.param_groups:
        for p in group["params"]:
            param_names.setdefault(p, f"optimizer.{len(param_names)}")

    weak = _storages_are_stable(torch)
    rec = _Recorder(torch, {}, weak)
    held = []                         # keeps pre-named storages alive (their keys stay valid)
    for sid, _, t in tensors:
        for part, part_sid in rec.named_parts(t, sid):
            key, s = rec._key(part)
            if key is not None and key not in rec.prenamed:
                rec.prenamed[key] = part_sid
                held.append(s)

    overrides = {}                    # internal id -> "grad:..." / "state:..."

    def name_tensor(t, sid):
        for part, part_sid in rec.named_parts(t, sid):
            iid = rec.iid_of(part)
            if iid is not None and not rec.base[iid].startswith(("param:", "input:")):
                overrides.setdefault(iid, part_sid)

    training = [(m, m.training) for m in model.modules()]
    grad_enabled = torch.is_grad_enabled()
    hooks = []
    mode = _mode_class(TorchDispatchMode)(rec)
    try:
        for child in model.children():
            if isinstance(child, torch.jit.ScriptModule):
                continue                 # no hooks on TorchScript modules: no layer marks
            hooks.append(child.register_forward_pre_hook(rec.layer))
            hooks.append(child.register_forward_hook(rec.layer))
        model.train()
        with torch.inference_mode(False), torch.enable_grad(), mode:
            for _ in range(steps):
                rec.begin_step()
                out = model(*args)
                loss = loss_fn(out)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or \
                        loss.is_complex():
                    raise TypeError(f"loss_fn must return a real scalar tensor, got "
                                    f"{type(loss).__name__}"
                                    + (f" of shape {tuple(loss.shape)} and dtype {loss.dtype}"
                                       if isinstance(loss, torch.Tensor) else ""))
                if not loss.requires_grad:
                    raise ValueError("the loss does not require grad: it must depend on the "
                                     "model's trainable parameters")
                before = _grads(trained) if not rec.step_ranges else None
                loss.backward()
                if before is not None and not _wrote_a_grad(trained, before):
                    raise ValueError("the loss does not depend on any parameter the optimizer "
                                     "trains: give loss_fn a loss computed from the model's "
                                     "output, and an optimizer over the model's parameters")
                for p, n in param_names.items():
                    if p.grad is not None:
                        name_tensor(p.grad, f"grad:{n}")
                optimizer.step()
                for p, state in optimizer.state.items():
                    n = param_names.get(p, "optimizer")
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor):
                            name_tensor(v, f"state:{n}.{k}")
                optimizer.zero_grad()
                model.zero_grad()
                del out, loss
                rec.end_step()
    finally:
        rec.closed = True
        for h in hooks:
            h.remove()
        for m, flag in training:
            m.training = flag
        torch.set_grad_enabled(grad_enabled)

    times, how, timed = rec.median_times()
    objects, events, kernels = rec.build(overrides)
    meta = {
        "source": "torch",
        "model": name if name is not None else type(model).__name__,
        "steps": steps,
        "optimizer": type(optimizer).__name__,
        "torch": torch.__version__,
        "times": how,
        "timed_steps": timed,
        "kernels_per_step": [b - a for a, b in rec.step_ranges],
        "objects_by": "storage" if weak else "data_ptr+nbytes",
    }
    rec.live.clear()
    rec.refs.clear()
    del held
    return Trace(objects, events, kernels, times, meta=meta)
