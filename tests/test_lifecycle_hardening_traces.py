"""Recordings at the end of their life and the sizes they record: a planning policy's profile
lets go of the kernel clock when it ends, a replay's fast=1.0 holds what the fast-only run held
(heap headers and rounding included), empty arrays replay, and from_torch records a storage
that grows at its new size."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.replay import evaluate
from cachedarrays.trace import KernelClock, Recorder

POLICIES = ["fastonly", "checkpoint", "capuchin", "uvm", "flashneuron",
                                  "lru", "sentinel", "deeptm", "autotm"]


def program(m, sizes=(4096,), steps=2):
    """A traced program: a weight read each step into new arrays of the given element counts."""
    w = ca.asarray(np.ones(4096), manager=m)
    with ca.trace(m) as t:
        for _ in range(steps):
            for n in sizes:
                h = ca.empty(n, manager=m)
                with ca.kernel("mul", reads=(w,), writes=(h,)) as (a, o):
                    np.multiply(a[:n] if n <= 4096 else a[0], 2.0, out=o)
                g = np.tanh(h)
                del h, g
            ca.mark_step(m)
    return t


@pytest.fixture(scope="module", params=[(4096,), (1000, 3, 2500, 129)], ids=["even", "odd"])
def recorded(request):
    with ca.Manager(fast="1MiB", slow="16MiB", policy="fastonly") as m:
        return program(m, request.param)


# ---- a planning policy's profile ends with its recording ----------------------------------------

@pytest.mark.parametrize("policy", ["sentinel", "capuchin", "deeptm", "autotm", "g10"])
def test_a_planning_policy_lets_go_of_the_kernel_clock_after_its_profile(policy):
    tiers = [("dram", "1MiB"), ("pmem", "8MiB"), ("ssd", "16MiB")] if policy == "g10" else None
    with (ca.Manager(tiers=tiers, policy=policy) if tiers else
          ca.Manager(fast="1MiB", slow="8MiB", policy=policy)) as m:
        w = ca.asarray(np.ones(4096), manager=m)
        for step in range(3):
            h = ca.empty(4096, manager=m)
            with ca.kernel("mul", reads=(w,), writes=(h,)) as (a, o):
                np.multiply(a, 2.0, out=o)
            del h
            ca.mark_step(m)
            kinds = {type(o) for o in m._observers}
            if step >= 1:                       # the profile (step 1) has ended
                assert Recorder not in kinds and KernelClock not in kinds, kinds
        with ca.trace(m) as t:                  # a recording afterwards still gets times
            h = np.tanh(w)
        assert t.times and KernelClock not in {type(o) for o in m._observers}


# ---- fast=1.0 holds what the fast-only run held -------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_a_replay_with_all_of_the_footprint_holds_what_the_fast_only_run_held(recorded, policy):
    run = ca.replay(recorded, policy)           # fast=1.0
    assert run.info["fast"] == recorded.footprint()
    assert run.result.total.bytes_moved == 0    # everything fits: nothing is ever evicted


def test_g10_holds_the_footprint_in_its_fast_tier(recorded):
    run = ca.replay(recorded, "g10", tiers=[("dram", 1.0), ("pmem", 2.0), ("ssd", 4.0)])
    assert run.info["fast"] == recorded.footprint()
    assert run.result.total.bytes_moved == 0


def test_the_footprint_in_heap_blocks_counts_headers_and_rounding(recorded):
    data = recorded.footprint()
    blocks = recorded.footprint(256)
    live = [n for n in recorded.objects.values() if n]
    assert data < blocks <= data + len(live) * (64 + 255)
    assert recorded.footprint(0) == blocks      # 0: the heap's default granularity
    assert recorded.footprint(4096) >= blocks
    with ca.Manager(fast="1MiB", slow="16MiB") as m:
        w = ca.asarray(np.ones(4096), manager=m)   # 32 KiB: one block of 32 KiB + 256
        with ca.trace(m) as t:
            ca.mark_step(m)
        assert w.size and t.footprint() == 32768 and t.footprint(256) == 32768 + 256


# ---- empty arrays -------------------------------------------------------------------------------

def test_a_trace_with_empty_arrays_replays():
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        w = ca.asarray(np.ones(512), manager=m)
        with ca.trace(m) as t:
            for _ in range(2):
                z = ca.empty(0, manager=m)
                with ca.kernel("k", reads=(w,), writes=(z,)):
                    pass
                ca.evict(z)
                del z
                ca.mark_step(m)
    assert all(d[3] >= 0 for d in t.decisions if d[0] in ("alloc", "free"))
    assert ca.replay(t, "lru").last.time >= 0
    evaluate(t)


# ---- from_torch: storages that grow --------------------------------------------------------------

def _torch_trace(grow):
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            buf = torch.empty(0)
            grow(torch, x, buf)
            return (buf.view(64, 64) @ self.w).sum()

    torch.manual_seed(0)
    return ca.from_torch(Net(), torch.randn(64, 64), lambda o: o, steps=2)


GROWERS = {
    "out=": lambda torch, x, buf: torch.mul(x, 2.0, out=buf),
    "resize_": lambda torch, x, buf: (buf.resize_(64, 64), buf.copy_(x)),
    "out= of a reduction": lambda torch, x, buf: torch.cumsum(x, 0, out=buf),
}


@pytest.mark.parametrize("how", sorted(GROWERS))
def test_from_torch_records_a_storage_that_grows_at_its_new_size(how):
    t = _torch_trace(GROWERS[how])
    t.validate()
    used = [(name, s, t.objects[s]) for name, reads, writes in t.kernels
            if "empty" not in name for s in (*reads, *writes) if s.startswith("act:empty")]
    assert len(used) >= 4                       # the grow, and the mm that reads the buffer
    assert all(n == 64 * 64 * 4 for _, _, n in used), used
    assert t.footprint() >= 3 * 64 * 64 * 4
    run = ca.replay(t, "lru", fast=0.5)
    assert sum(run.last.kernel_read.values()) >= 2 * 64 * 64 * 4
