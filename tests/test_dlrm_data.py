"""LFSR scrambling, Zipf sampling, synthetic batches and the Criteo reader/converter."""

import gzip

import numpy as np
import pytest

from cachedarrays.models.dlrm import criteo as C
from cachedarrays.models.dlrm import data as D
from cachedarrays.models.dlrm import kernels as K

# --- LFSR -----------------------------------------------------------------------------------


@pytest.mark.parametrize("width", range(2, 17))
def test_lfsr_walk_has_maximal_period(width):
    assert D.lfsr_period(width) == 2**width - 1


def test_lfsr_masks_are_maximal_for_every_width():
    assert sorted(D.LFSR_MASKS) == list(range(2, 41))
    assert all(D.lfsr_is_maximal(w) for w in D.LFSR_MASKS)


def test_lfsr_check_rejects_a_non_maximal_mask():
    assert D.lfsr_period(4, mask=0xF) < 15  # x^4+x^3+x^2+x+1 is irreducible but not primitive
    assert not D.lfsr_is_maximal(4, mask=0xF)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 1024, 1025, 4097])
def test_scramble_is_a_bijection(n):
    rows = D.LFSRScrambler(n, seed=5)(np.arange(n))
    assert np.array_equal(np.sort(rows), np.arange(n))


def test_scramble_differs_per_seed_and_spreads_hot_ranks():
    a = D.LFSRScrambler(100_000, seed=[0, 1])(np.arange(16))
    b = D.LFSRScrambler(100_000, seed=[0, 2])(np.arange(16))
    assert not np.array_equal(a, b)
    assert np.ptp(a) > 50_000  # the 16 hottest rows are not clustered at the start
    with pytest.raises(IndexError):
        D.LFSRScrambler(10)(np.array([10]))


# --- Zipf -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n, alpha", [(1000, 1.0), (50_000, 1.3), (200, 0.5)])
def test_zipf_rank_frequencies_follow_the_law(n, alpha):
    z = D.ZipfSampler(n, alpha)
    draws = z.sample(np.random.default_rng(7), 200_000)
    assert draws.min() >= 0 and draws.max() < n
    freq = np.bincount(draws, minlength=n) / draws.size
    for rank in range(3):
        p = z.probability(rank)
        assert abs(freq[rank] - p) < 4 * np.sqrt(p * (1 - p) / draws.size) + 1e-4
    assert freq[0] / freq[1] == pytest.approx(2**alpha, rel=0.05)


def test_zipf_alpha_zero_is_uniform():
    draws = D.ZipfSampler(10, 0.0).sample(np.random.default_rng(1), 50_000)
    freq = np.bincount(draws, minlength=10) / draws.size
    assert np.allclose(freq, 0.1, atol=0.01)


# --- synthetic dataset ----------------------------------------------------------------------


def test_synthetic_batches_have_kernel_ready_shapes():
    ds = D.SyntheticDataset(13, [100, 5000, 3], batch_size=64, pooling=(0, 6),
                            distribution="zipf", alpha=1.1, seed=3, num_batches=4)
    assert len(ds) == 4 and len(list(ds)) == 4
    b = ds.batch(2)
    assert b.dense.shape == (64, 13) and b.dense.dtype == np.float32
    assert b.labels.shape == (64,) and b.labels.dtype == np.float32
    assert set(np.unique(b.labels)) <= {0.0, 1.0}
    for idx, off, n in zip(b.indices, b.offsets, ds.table_sizes):
        assert idx.dtype == np.int64 and off.dtype == np.int64 and off.shape == (64,)
        K.check_indices(idx, n)
        K.check_offsets(off, idx.size, 64)


def test_synthetic_dataset_is_deterministic_per_seed_and_batch():
    make = lambda seed: D.SyntheticDataset(4, [50, 70], 32, pooling=3, distribution="zipf",
                                           seed=seed)
    a, b, c = make(1).batch(5), make(1).batch(5), make(2).batch(5)
    assert np.array_equal(a.dense, b.dense) and np.array_equal(a.labels, b.labels)
    assert all(np.array_equal(x, y) for x, y in zip(a.indices, b.indices))
    assert not np.array_equal(a.indices[0], c.indices[0])
    assert not np.array_equal(make(1).batch(6).dense, a.dense)


def test_synthetic_uniform_fixed_pooling():
    b = D.SyntheticDataset(2, [10], 8, pooling=4, seed=0).batch(0)
    assert np.array_equal(b.offsets[0], np.arange(0, 32, 4))
    assert b.indices[0].size == 32 and b.indices[0].max() < 10


def test_synthetic_labels_are_learnable():
    ds = D.SyntheticDataset(8, [20, 30], 512, pooling=2, distribution="zipf", seed=11)
    train = [ds.batch(i) for i in range(8)]
    test = ds.batch(100)

    def features(b):  # dense features plus one-hot bag counts of every table
        cols = [b.dense]
        for idx, off, n in zip(b.indices, b.offsets, ds.table_sizes):
            bags = np.repeat(np.arange(b.batch_size), np.diff(np.append(off, idx.size)))
            onehot = np.zeros((b.batch_size, n), dtype=np.float32)
            np.add.at(onehot, (bags, idx), 1.0)
            cols.append(onehot)
        return np.hstack(cols)

    X = np.vstack([features(b) for b in train])
    y = np.concatenate([b.labels for b in train])
    w, bias = np.zeros(X.shape[1]), 0.0
    for _ in range(300):
        p = 1 / (1 + np.exp(-(X @ w + bias)))
        w -= 0.5 * X.T @ (p - y) / y.size
        bias -= 0.5 * np.mean(p - y)

    def bce(p, y):
        p = np.clip(p, 1e-7, 1 - 1e-7)
        return -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))

    pt = 1 / (1 + np.exp(-(features(test) @ w + bias)))
    assert bce(pt, test.labels) < bce(np.full_like(pt, y.mean()), test.labels) - 0.05


# --- Criteo ---------------------------------------------------------------------------------

SIZES = [7, 1000, 3] + [50] * 23


def test_parse_line_handles_missing_and_negative_fields():
    fields = ["1", "", "-5", "3"] + [""] * 10 + ["0000000a", ""] + ["ffffffff"] * 24
    label, dense, sparse = C.parse_line("\t".join(fields), SIZES)
    assert label == 1.0
    assert dense[0] == 0.0 and dense[1] == 0.0 and dense[2] == pytest.approx(np.log(4.0))
    assert sparse[0] == 10 % 7 and sparse[1] == 0
    assert sparse[2] == 0xFFFFFFFF % 3 and sparse.dtype == np.int64


def test_parse_line_rejects_wrong_field_count():
    with pytest.raises(ValueError, match="40"):
        C.parse_line("1\t2\t3", SIZES)


def test_tiny_criteo_round_trip(tmp_path):
    tsv = tmp_path / "tiny.tsv"
    C.write_tiny_criteo(tsv, nrows=237, seed=4)
    lines = tsv.read_text().splitlines()
    assert len(lines) == 237 and all(len(line.split("\t")) == 40 for line in lines)
    assert any("\t\t" in line for line in lines)  # some empty fields

    direct = [C.parse_line(line, SIZES) for line in lines]
    chunks = list(C.read_criteo(tsv, SIZES, chunk_rows=50))
    assert [c[0].shape[0] for c in chunks] == [50, 50, 50, 50, 37]
    labels = np.concatenate([c[0] for c in chunks])
    dense = np.concatenate([c[1] for c in chunks])
    sparse = np.concatenate([c[2] for c in chunks])
    assert np.array_equal(labels, [d[0] for d in direct])
    assert np.array_equal(dense, np.stack([d[1] for d in direct]))
    assert np.array_equal(sparse, np.stack([d[2] for d in direct]))

    out = tmp_path / "converted"
    assert C.convert_criteo(tsv, out, SIZES, chunk_rows=64) == 237
    ds = C.CriteoDataset(out, batch_size=100, table_sizes=SIZES)
    assert len(ds) == 2  # the partial last batch is dropped
    batches = list(ds)
    for i, b in enumerate(batches):
        rows = slice(100 * i, 100 * (i + 1))
        assert np.array_equal(b.labels, labels[rows]) and b.labels.dtype == np.float32
        assert np.array_equal(b.dense, dense[rows]) and b.dense.dtype == np.float32
        for t in range(26):
            assert np.array_equal(b.indices[t], sparse[rows, t])
            assert np.array_equal(b.offsets[t], np.arange(100))
            K.check_indices(b.indices[t], SIZES[t])
    tail = C.CriteoDataset(out, batch_size=100, table_sizes=SIZES, drop_last=False)
    assert len(tail) == 3 and tail.batch(2).labels.shape == (37,)


def test_gzip_input_and_table_size_check(tmp_path):
    tsv = tmp_path / "t.tsv"
    C.write_tiny_criteo(tsv, nrows=20, seed=1)
    gz = tmp_path / "t.tsv.gz"
    gz.write_bytes(gzip.compress(tsv.read_bytes()))
    a = np.concatenate([c[2] for c in C.read_criteo(tsv, SIZES)])
    b = np.concatenate([c[2] for c in C.read_criteo(gz, SIZES)])
    assert np.array_equal(a, b)
    out = tmp_path / "conv"
    C.convert_criteo(tsv, out, SIZES)
    with pytest.raises(ValueError, match="table 1"):
        C.CriteoDataset(out, batch_size=4, table_sizes=[7, 2000, 3] + [50] * 23)
