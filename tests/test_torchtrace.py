"""cachedarrays.torchtrace.from_torch: a PyTorch training loop recorded as a Trace."""

import json
import sys

import pytest

torch = pytest.importorskip("torch")

from cachedarrays.torchtrace import from_torch  # noqa: E402
from cachedarrays.trace import Trace  # noqa: E402

nn = torch.nn


# -- models ---------------------------------------------------------------------------------

def mlp(inplace=False):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=inplace), nn.Linear(16, 4))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(self.relu(self.bn(self.conv(x))).flatten(1))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(5, 3)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


X = torch.randn(5, 8)
Y = torch.randint(0, 4, (5,))


def xent(out):
    return nn.functional.cross_entropy(out, Y)


def trace_mlp(**kw):
    return from_torch(mlp(kw.pop("inplace", False)), X, xent, **kw)


@pytest.fixture(scope="module")
def mlp_trace():
    return trace_mlp(steps=3)


@pytest.fixture(scope="module")
def conv_trace():
    torch.manual_seed(0)
    return from_torch(ConvNet(), torch.randn(2, 3, 6, 6), lambda o: o.square().mean(), steps=3)


# -- helpers --------------------------------------------------------------------------------

def check_well_formed(trace):
    """The Trace contract, checked event by event (and by Trace's own validation if any)."""
    for name in ("validate", "check"):
        if callable(getattr(trace, name, None)):
            getattr(trace, name)()
    assert len(trace.times) == len(trace.kernels)
    assert all(t >= 0 for t in trace.times)
    alive, seen_kernels, allocated = set(), [], []
    events = trace.events
    for i, ev in enumerate(events):
        tag = ev[0]
        if tag == "alloc":
            _, sid, nbytes, placement = ev
            assert placement is None
            assert sid not in alive, f"{sid} allocated twice"
            assert trace.objects[sid] == nbytes
            alive.add(sid)
            allocated.append(sid)
        elif tag == "free":
            assert ev[1] in alive, f"{ev[1]} freed while not allocated"
            alive.remove(ev[1])
        elif tag == "kernel":
            k = ev[1]
            assert events[i + 1] == ("end", k), "kernel k must be followed by its end"
            name, reads, writes = trace.kernels[k]
            assert isinstance(name, str)
            for sid in reads + writes:
                assert sid in alive, f"kernel {k} {name} uses {sid}, not allocated"
            seen_kernels.append(k)
        elif tag == "end":
            assert events[i - 1] == ("kernel", ev[1])
        else:
            assert ev in (("layer",), ("step",)), ev
    assert seen_kernels == list(range(len(trace.kernels)))
    assert list(trace.objects) == list(dict.fromkeys(allocated)), "objects in first-alloc order"


def steps_of(trace):
    """Per step: the list of its events (without the ("step",) mark)."""
    out, cur = [], []
    for ev in trace.events:
        if ev == ("step",):
            out.append(cur)
            cur = []
        else:
            cur.append(ev)
    assert not cur, "events after the last step mark"
    return out


def step_kernels(trace, step):
    return [trace.kernels[ev[1]] for ev in step if ev[0] == "kernel"]


def used_sids(trace, step):
    return {sid for _, r, w in step_kernels(trace, step) for sid in r + w}


# -- tests ----------------------------------------------------------------------------------

def test_kernels_are_recorded_as_a_well_formed_trace(mlp_trace):
    t = mlp_trace
    assert isinstance(t, Trace)
    check_well_formed(t)
    names = {n for n, _, _ in t.kernels}
    assert {"aten.addmm.default", "aten.mm.default", "aten.add_.Tensor"} <= names
    assert t.meta["source"] == "torch" and t.meta["model"] == "Sequential"
    assert t.meta["steps"] == 3 and t.events.count(("step",)) == 3
    json.dumps(t.meta)                                  # JSON-able
    assert ("layer",) in t.events                       # boundaries of the direct children


def test_conv_bn_net_is_well_formed(conv_trace):
    check_well_formed(conv_trace)
    assert any(n.startswith("aten.convolution_backward") for n, _, _ in conv_trace.kernels)


def test_sids_are_stable_across_steps(mlp_trace, conv_trace):
    for t in (mlp_trace, conv_trace):
        s1, s2, s3 = steps_of(t)
        assert used_sids(t, s2) == used_sids(t, s3)
        assert step_kernels(t, s2) == step_kernels(t, s3)   # same names, operands, order
        assert [e for e in s2 if e[0] != "kernel" and e[0] != "end"] == \
               [e for e in s3 if e[0] != "kernel" and e[0] != "end"]


def test_parameters_are_read_in_forward_and_written_by_the_optimizer(mlp_trace):
    t = mlp_trace
    assert {"param:0.weight", "param:0.bias", "param:2.weight", "param:2.bias",
            "input:0"} <= set(t.objects)
    for step in steps_of(t):
        ks = step_kernels(t, step)
        addmm = [k for k in ks if k[0] == "aten.addmm.default"]
        assert "param:0.weight" in addmm[0][1] and "input:0" in addmm[0][1]
        updates = [k for k in ks if k[0] == "aten.add_.Tensor" and k[2] == ("param:0.weight",)]
        assert updates and "grad:0.weight" in updates[0][1]
        assert "param:0.weight" in updates[0][1]        # in place: read and written
    assert t.objects["grad:0.weight"] == t.objects["param:0.weight"] == 16 * 8 * 4


def test_parameters_and_inputs_allocated_once_and_activations_freed_each_step(mlp_trace):
    t = mlp_trace
    allocs = [e[1] for e in t.events if e[0] == "alloc"]
    for sid in ("param:0.weight", "input:0"):
        assert allocs.count(sid) == 1
    alive = set()
    for step in steps_of(t):
        assert any(e[0] == "free" for e in step)
        for e in step:
            if e[0] == "alloc":
                alive.add(e[1])
            elif e[0] == "free":
                alive.discard(e[1])
        # at a step mark only long-lived objects remain: no activation, no gradient
        assert {s.split(":")[0] for s in alive} <= {"param", "input", "ext", "state"}, alive
    assert allocs.count("act:addmm#0") == 3 and allocs.count("grad:0.weight") == 3


def test_batchnorm_running_stats_are_written(conv_trace):
    bn = [k for k in conv_trace.kernels if k[0] == "aten.native_batch_norm.default"]
    assert bn and {"param:bn.running_mean", "param:bn.running_var"} <= set(bn[-1][2])
    assert any("param:bn.num_batches_tracked" in w for _, _, w in conv_trace.kernels)


def test_inplace_op_reads_and_writes(conv_trace):
    relu_ = [k for k in conv_trace.kernels if k[0] == "aten.relu_.default"]
    assert relu_
    _, reads, writes = relu_[-1]
    assert reads == writes and len(reads) == 1


def test_view_ops_touch_no_data(mlp_trace):
    views = [k for k in mlp_trace.kernels if k[0] in ("aten.t.default", "aten.detach.default")]
    assert views and all(r == () and w == () for _, r, w in views)


def test_times_are_medians_over_identical_steps(mlp_trace):
    t = mlp_trace
    assert t.meta["times"] == "median of 3 steps" and t.meta["timed_steps"] == [1, 2, 3]
    n = t.meta["kernels_per_step"][0]
    assert t.meta["kernels_per_step"] == [n, n, n] and len(t.kernels) == 3 * n
    assert t.times[:n] == t.times[n:2 * n] == t.times[2 * n:]
    assert all(x >= 0 for x in t.times) and sum(t.times) > 0


def test_times_when_the_first_step_differs():
    # SGD with momentum clones the gradient in step 1 and updates the buffer in place after
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    t = from_torch(model, X, xent, steps=3, optimizer=opt)
    check_well_formed(t)
    assert t.meta["times"] == "median of 2 steps" and t.meta["timed_steps"] == [2, 3]
    a, b, c = t.meta["kernels_per_step"]
    assert t.times[a:a + b] == t.times[a + b:]
    assert "state:0.weight.momentum_buffer" in t.objects
    s1, s2, s3 = steps_of(t)
    assert used_sids(t, s2) == used_sids(t, s3)


def test_one_step_has_raw_times():
    t = trace_mlp(steps=1)
    check_well_formed(t)
    assert t.meta["times"] == "raw" and t.events.count(("step",)) == 1


def test_optimizer_updates_the_model_and_flags_are_restored():
    model = mlp()
    model.eval()
    before = model[0].weight.detach().clone()
    with torch.no_grad():
        t = from_torch(model, X, xent, steps=2, name="tiny")
        assert not torch.is_grad_enabled()
    assert not model.training and not model[0].training
    assert not torch.equal(before, model[0].weight)       # a real SGD step happened
    assert model[0].weight.grad is None                   # zero_grad(set_to_none)
    assert t.meta["model"] == "tiny" and t.meta["optimizer"] == "SGD"


def test_several_inputs():
    torch.manual_seed(0)
    t = from_torch(TwoInputs(), (torch.randn(2, 4), torch.randn(2, 5)),
                   lambda o: o.sum(), steps=2)
    check_well_formed(t)
    assert {"input:0", "input:1", "param:a.weight", "param:b.weight"} <= set(t.objects)


def test_exception_in_a_step_propagates_after_the_mode_exits():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = mlp()
    model.eval()

    def bad_loss(out):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        from_torch(model, X, bad_loss)
    assert _get_current_dispatch_mode() is None
    assert not model.training and torch.is_grad_enabled()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_non_cpu_models_and_inputs_are_refused():
    model = mlp().to("meta")
    with pytest.raises(ValueError, match="CPU"):
        from_torch(model, X, xent)
    with pytest.raises(ValueError, match="CPU"):
        from_torch(mlp(), X.to("meta"), xent)


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        from_torch(lambda x: x, X, xent)
    with pytest.raises(ValueError, match="steps"):
        from_torch(mlp(), X, xent, steps=0)
    with pytest.raises(TypeError, match="steps"):
        from_torch(mlp(), X, xent, steps=2.0)
    with pytest.raises(TypeError, match="loss_fn"):
        from_torch(mlp(), X, None)
    with pytest.raises(TypeError, match="inputs"):
        from_torch(mlp(), {"x": X}, xent)
    with pytest.raises(TypeError, match="scalar"):
        from_torch(mlp(), X, lambda o: o)


def test_missing_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r'pip install "cachedarrays\[peer\]"'):
        from_torch(object(), X, xent)


def test_fallback_without_weakref_able_storages(monkeypatch):
    import cachedarrays.torchtrace as tt

    monkeypatch.setattr(tt, "_storages_are_stable", lambda torch: False)
    t = trace_mlp(steps=2)
    check_well_formed(t)
    assert t.meta["objects_by"] == "data_ptr+nbytes"
    assert "param:0.weight" in t.objects


def test_save_and_load_round_trip(mlp_trace, tmp_path):
    path = mlp_trace.save(tmp_path / "mlp.trace")
    back = Trace.load(path)
    assert back.objects == mlp_trace.objects and back.events == mlp_trace.events
    assert back.kernels == mlp_trace.kernels and back.times == mlp_trace.times
    assert back.meta == mlp_trace.meta and back.steps == 3
