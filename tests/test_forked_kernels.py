"""Kernels in a child forked after the parent started its OpenMP pool.

GNU OpenMP is not fork-safe: in such a child a parallel region of numba's OpenMP layer makes
numba terminate the process, and a oneDNN primitive on several threads never returns. The
library's kernels run on the calling thread there (``threads.FORKED_AFTER_POOL``): the child
computes what the parent computed, and a child forked before any pool keeps its threads.
"""

import subprocess
import sys
import textwrap

import pytest

from cachedarrays.models.backend import available_backends

SCRIPT = r'''
import os, sys, time
import numpy as np
import cachedarrays as ca
from cachedarrays import threads
from cachedarrays.models.backend import get_backend
from cachedarrays.models.backend import onednn
from cachedarrays.models.dlrm import kernels as K
from cachedarrays.models.dlrm import model as M

K.set_specialised(False)            # the kernels the suite compiles (numba's disk cache)
M.set_specialised(False)
rng = np.random.default_rng(0)
table = rng.standard_normal((5000, 16)).astype(np.float32)
n = 4 * K.SERIAL_INDICES
idx = rng.integers(0, 5000, n)
off = np.arange(0, n, 8)
dout = rng.standard_normal((off.shape[0], 16)).astype(np.float32)
x = rng.standard_normal((512, 256)).astype(np.float32)
w = rng.standard_normal((384, 256)).astype(np.float32)
t = rng.standard_normal((300, 4 * 16)).astype(np.float32)
xb = rng.standard_normal((8, 32, 12, 12)).astype(np.float32)
g, bta = np.ones(32, np.float32), np.zeros(32, np.float32)
dnn = get_backend("onednn")


def work():
    """Every kind of parallel kernel, large enough for a parallel region."""
    rng_pool = np.random.default_rng(1)
    out = [K.lookup_sum(table, idx, off)]
    upd = table.copy()
    K.sgd_update(upd, idx, off, dout, 0.1)
    out.append(upd)
    out.append(M.dot_interaction(t, 4, 16))
    out.append(dnn.dense_forward(x, w, None, np.empty((512, 384), np.float32)))
    y = np.empty_like(xb)
    mean, var = np.empty(32, np.float32), np.empty(32, np.float32)
    onednn._bnorm.forward(xb, g, bta, 1e-5, y, mean, var)
    out.append(y)
    xp = rng_pool.standard_normal((16, 64, 32, 32)).astype(np.float32)
    yp = np.empty((16, 64, 16, 16), np.float32)
    state = dnn.maxpool_forward(xp, 2, 2, 0, yp)
    dx = np.empty_like(xp)
    dnn.maxpool_backward(np.ones_like(yp), xp, state, 2, 2, 0, dx)  # a primitive made for the
    out += [yp, dx]                 # pool keeps its thread count: the child makes its own
    return out


if sys.argv[1] == "after":
    want = work()                   # the pool runs in the parent
    assert threads.FORKED_AFTER_POOL is False
pid = os.fork()
if pid == 0:
    if sys.argv[1] == "before":
        os._exit(0 if threads.FORKED_AFTER_POOL is False else 4)
    assert threads.FORKED_AFTER_POOL is True
    got = work()
    same = all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, want))
    os._exit(0 if same else 3)
for _ in range(1200):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("status", status)
        break
    time.sleep(0.1)
else:
    os.kill(pid, 9)
    print("status hung")
'''


@pytest.mark.skipif("onednn" not in available_backends(), reason="oneDNN not installed")
@pytest.mark.parametrize("when", ["after", "before"])
def test_kernels_run_in_a_child_forked_after_the_pool_started(when):
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), when],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-2:] == ["status", "0"], (run.stdout, run.stderr)
