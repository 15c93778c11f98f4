"""The DLRM data paths under hostile use: malformed Criteo input, hostile paths, a converter
killed or run twice, converted files changed afterwards, wrong arguments to the datasets, and
CachedArray chunks of every dtype sent through dask.distributed's serializers."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from cachedarrays.models.dlrm import configs, synthetic_dataset
from cachedarrays.models.dlrm import criteo as C
from cachedarrays.models.dlrm import data as D
from cachedarrays.models.dlrm import kernels as K

SIZES = [7, 1000, 3] + [50] * 23


@pytest.fixture
def tsv(tmp_path):
    return C.write_tiny_criteo(tmp_path / "tiny.tsv", nrows=120, seed=2)


@pytest.fixture
def converted(tmp_path, tsv):
    out = tmp_path / "converted"
    assert C.convert_criteo(tsv, out, SIZES) == 120
    return out


def _line(tsv, field=None, value=None):
    fields = tsv.read_text().splitlines()[0].split("\t")
    if field is not None:
        fields[field] = value
    return "\t".join(fields)


def _same_batches(a, b):
    return all(np.array_equal(x.dense, y.dense) and np.array_equal(x.labels, y.labels)
               and all(np.array_equal(i, j) for i, j in zip(x.indices, y.indices))
               for x, y in zip(a, b))


# --- malformed TSV input --------------------------------------------------------------------

BAD_FIELDS = [
    (0, "2", "label"), (0, "-1", "label"), (0, "1.0", "label"), (0, " 1", "label"),
    (3, "1.5", "integer count"), (3, "nan", "integer count"), (3, "1_000", "integer count"),
    (3, " 12", "integer count"), (3, "1-2", "integer count"), (3, "9" * 400, "integer count"),
    (3, "9" * 5000, "integer count"), (3, "+4", "integer count"),
    (20, "zzzz", "hexadecimal hash"), (20, "0x1a", "hexadecimal hash"),
    (20, "-1a", "hexadecimal hash"), (20, "1_a", "hexadecimal hash"),
    (20, "\u00e9", "hexadecimal hash"),
]


@pytest.mark.parametrize("field, value, kind", BAD_FIELDS)
def test_a_malformed_field_is_refused_naming_its_line_and_field(tmp_path, tsv, field, value,
                                                                 kind):
    good = tsv.read_text().splitlines()
    bad = _line(tsv, field, value)
    src = tmp_path / "bad.tsv"
    src.write_bytes(("\n".join(good[:3] + ["", bad] + good[3:6]) + "\n").encode("utf-8"))
    with pytest.raises(ValueError, match=f"line 5: field {field + 1} .*{kind}"):
        list(C.read_criteo(src, SIZES, chunk_rows=2))
    with pytest.raises(ValueError, match=f"field {field + 1} .*{kind}"):
        C.parse_line(bad, SIZES)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="line 5"):
        C.convert_criteo(src, out, SIZES, chunk_rows=2)
    with pytest.raises(FileNotFoundError, match="not a finished Criteo conversion"):
        C.CriteoDataset(out, 1)


def test_line_numbers_count_blank_lines_and_crlf_and_blank_lines_are_read(tmp_path, tsv):
    good = tsv.read_text().splitlines()
    src = tmp_path / "crlf.tsv"
    src.write_bytes(("\r\n".join(["", "  ", good[0], "", good[1], "1\t2"]) + "\r\n").encode())
    with pytest.raises(ValueError, match="line 6: expected 40 tab-separated fields"):
        list(C.read_criteo(src, SIZES))
    src.write_bytes(("\r\n".join(["", good[0], "", good[1]]) + "\r\n").encode())
    labels, dense, sparse = next(C.read_criteo(src, SIZES))
    want = [C.parse_line(line, SIZES) for line in good[:2]]
    assert np.array_equal(sparse, np.stack([w[2] for w in want]))
    empty = tmp_path / "empty.tsv"
    empty.write_text("\t" * 39 + "\n")       # every field empty is a row
    assert next(C.read_criteo(empty, SIZES))[0].tolist() == [0.0]


def test_a_truncated_or_damaged_gzip_names_the_file(tmp_path, tsv):
    import gzip
    gz = tmp_path / "t.tsv.gz"
    gz.write_bytes(gzip.compress(tsv.read_bytes())[:400])
    with pytest.raises(ValueError, match="t.tsv.gz: the gzip stream is truncated or damaged"):
        C.convert_criteo(gz, tmp_path / "out", SIZES)
    data = bytearray(gzip.compress(tsv.read_bytes()))
    data[2] = 7                               # an unknown compression method
    gz.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="gzip stream is truncated or damaged"):
        list(C.read_criteo(gz, SIZES))
    data = bytearray(gzip.compress(tsv.read_bytes()))
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    gz.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="gzip stream is truncated or damaged"):
        list(C.read_criteo(gz, SIZES))


def test_huge_hashes_and_counts_within_limits_are_read(tmp_path, tsv):
    line = _line(tsv, 20, "f" * 100)
    fields = line.split("\t")
    fields[3] = "9" * 300
    label, dense, sparse = C.parse_line("\t".join(fields), SIZES)
    assert sparse[6] == int("f" * 100, 16) % SIZES[6] and np.isfinite(dense[2])


# --- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes, error", [
    ("7" * 26, TypeError), ([7.5] * 26, TypeError), (7, TypeError), (None, TypeError),
    ([7] * 25, ValueError), ([0] + [7] * 25, ValueError), ([True] * 26, TypeError),
])
def test_table_sizes_that_are_not_26_positive_integers_are_refused(tmp_path, tsv, sizes, error):
    with pytest.raises(error, match="table"):
        C.convert_criteo(tsv, tmp_path / "out", sizes)
    assert not (tmp_path / "out").exists()


def test_arguments_in_the_wrong_order_are_named(tmp_path, tsv, converted):
    with pytest.raises(TypeError, match="table_sizes must be a sequence"):
        C.convert_criteo(tsv, SIZES, tmp_path / "out")
    with pytest.raises(TypeError, match="out_dir must be a path"):
        C.convert_criteo(tsv, 5, SIZES)
    with pytest.raises(TypeError, match="path must be a path"):
        C.CriteoDataset(10, converted)
    with pytest.raises(TypeError, match="synthetic_dataset takes a DLRMConfig"):
        synthetic_dataset("zipf", configs.small(scale=0.001))


# --- hostile output paths -------------------------------------------------------------------


def test_an_output_path_that_is_not_a_directory_is_refused(tmp_path, tsv):
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        C.convert_criteo(tsv, tsv, SIZES)
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        C.convert_criteo(tsv, "/dev/null", SIZES)
    os.symlink(tmp_path / "missing", tmp_path / "dangling")
    with pytest.raises(FileNotFoundError, match="symbolic link to a missing"):
        C.convert_criteo(tsv, tmp_path / "dangling", SIZES)
    out = tmp_path / "out"
    out.mkdir()
    (out / "labels").write_text("mine")
    with pytest.raises(NotADirectoryError, match="labels exists and is not a directory"):
        C.convert_criteo(tsv, out, SIZES)
    assert (out / "labels").read_text() == "mine"


@pytest.mark.parametrize("name", ["labels", "dense", "sparse"])
def test_an_array_directory_that_is_a_symbolic_link_is_refused_and_its_target_kept(
        tmp_path, tsv, name):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.ninja").write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(elsewhere, out / name)
    with pytest.raises(ValueError, match=f"{name} is a symbolic link"):
        C.convert_criteo(tsv, out, SIZES)
    assert (elsewhere / "data.ninja").read_bytes() == b"precious"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_directory_is_refused(tmp_path, tsv):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match="not writable"):
            C.convert_criteo(tsv, out, SIZES)
    finally:
        out.chmod(0o755)


def test_paths_with_spaces_unicode_and_symlinks_work(tmp_path, tsv):
    out = tmp_path / "with space \u00e9\u4e2d"
    assert C.convert_criteo(str(tsv), str(out), SIZES) == 120
    os.symlink(out, tmp_path / "link")
    a, b = C.CriteoDataset(out, 7), C.CriteoDataset(tmp_path / "link", 7)
    assert len(a) == len(b) == 17 and _same_batches(a, b)


# --- interrupted, repeated and concurrent conversions ---------------------------------------


def _convert_in_child(src, out, chunk_rows):
    code = ("import sys; from cachedarrays.models.dlrm import criteo as C; "
            f"C.convert_criteo(sys.argv[1], sys.argv[2], {SIZES!r}, chunk_rows={chunk_rows})")
    return subprocess.Popen([sys.executable, "-c", code, str(src), str(out)])


def _open_feed(fifo, alive):
    """The FIFO's write end (blocking writes), once a reader has opened it; raises when
    ``alive()`` turns false or after a minute without a reader."""
    deadline = time.monotonic() + 60
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:          # ENXIO: no reader yet
            if not alive() or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
            continue
        os.set_blocking(fd, True)
        return fd


def _midway(out, rows):
    return not (out / "criteo.json").exists() and _rows_written(out) >= rows


def _rows_written(out):
    try:
        return int.from_bytes((out / "labels" / "shape.ninja").read_bytes()[:8], "little")
    except (OSError, ValueError):
        return 0


@pytest.mark.parametrize("previous", [False, True])
def test_a_converter_killed_midway_leaves_a_directory_that_says_so(tmp_path, tsv, previous):
    out = tmp_path / "out"
    if previous:
        C.convert_criteo(tsv, out, SIZES)
    fifo = tmp_path / "feed.tsv"
    os.mkfifo(fifo)
    child = _convert_in_child(fifo, out, chunk_rows=10)
    lines = tsv.read_text().splitlines(keepends=True)
    try:
        feed = _open_feed(fifo, lambda: child.poll() is None)
        os.write(feed, "".join(lines[:55]).encode())
        deadline = time.monotonic() + 60
        while not _midway(out, 50) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _midway(out, 50)
        child.send_signal(signal.SIGKILL)
        child.wait()
        os.close(feed)
    finally:
        child.kill()
        child.wait()
    with pytest.raises(FileNotFoundError, match="not a finished Criteo conversion"):
        C.CriteoDataset(out, 4)
    assert C.convert_criteo(tsv, out, SIZES) == 120
    assert len(C.CriteoDataset(out, 10)) == 12


def test_a_failed_start_keeps_the_previous_conversion(tmp_path, tsv, converted):
    before = list(C.CriteoDataset(converted, 10))
    bad = tmp_path / "bad.tsv"
    bad.write_text(_line(tsv, 0, "7") + "\n")
    for src, error in [(tmp_path / "missing.tsv", FileNotFoundError), (bad, ValueError),
                       ("/dev/null", ValueError)]:
        with pytest.raises(error):
            C.convert_criteo(src, converted, SIZES)
    assert _same_batches(before, C.CriteoDataset(converted, 10))


def test_converting_again_leaves_open_datasets_reading_their_data(tmp_path, tsv, converted):
    old = C.CriteoDataset(converted, 10)
    want = [old.batch(i) for i in range(len(old))]
    small = C.write_tiny_criteo(tmp_path / "small.tsv", nrows=15, seed=9)
    assert C.convert_criteo(small, converted, SIZES) == 15
    assert _same_batches(want, [old.batch(i) for i in range(len(old))])   # no SIGBUS
    assert C.CriteoDataset(converted, 5).rows == 15


def test_two_conversions_into_one_directory_do_not_mix(tmp_path, tsv):
    out = tmp_path / "out"
    fifo = tmp_path / "feed.tsv"
    os.mkfifo(fifo)
    result = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("rows", C.convert_criteo(fifo, out, SIZES, 10)))
    worker.start()
    feed = _open_feed(fifo, worker.is_alive)
    try:
        lines = tsv.read_text().splitlines(keepends=True)
        os.write(feed, "".join(lines[:30]).encode())
        deadline = time.monotonic() + 30
        while _rows_written(out) < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(BlockingIOError, match="another convert_criteo is writing"):
            C.convert_criteo(tsv, out, SIZES)
        os.write(feed, "".join(lines[30:]).encode())
    finally:
        os.close(feed)
        worker.join()
    assert result["rows"] == 120
    assert _same_batches(list(C.CriteoDataset(out, 10)),
                         list(C.CriteoDataset(_copy_converted(tmp_path, tsv), 10)))


def _copy_converted(tmp_path, tsv):
    other = tmp_path / "reference"
    C.convert_criteo(tsv, other, SIZES)
    return other


# --- converted files changed afterwards -----------------------------------------------------


def _append(p, data):
    with open(p, "ab") as f:
        f.write(data)


def _truncate(p, n):
    p.write_bytes(p.read_bytes()[:n])


def _poke(name, dtype, value):
    def change(out):
        a = np.memmap(out / name / "data.ninja", dtype=dtype, mode="r+")
        a[3] = value
        a.flush()
    return change


DAMAGE = {
    "data truncated": lambda out: _truncate(out / "dense" / "data.ninja", 100),
    "data empty": lambda out: _truncate(out / "sparse" / "data.ninja", 0),
    "data longer": lambda out: _append(out / "labels" / "data.ninja", b"\0" * 8),
    "dtype changed": lambda out: (out / "labels" / "dtype.ninja").write_text("int32"),
    "dtype unknown": lambda out: (out / "labels" / "dtype.ninja").write_text("nonsense"),
    "shape garbage": lambda out: (out / "sparse" / "shape.ninja").write_text("120,13"),
    "order F": lambda out: (out / "dense" / "order.ninja").write_text("F"),
    "array removed": lambda out: shutil.rmtree(out / "labels"),
    "file removed": lambda out: (out / "dense" / "shape.ninja").unlink(),
    "meta garbage": lambda out: (out / "criteo.json").write_text('{"format": 1, "ro'),
    "meta list": lambda out: (out / "criteo.json").write_text("[1, 2]"),
    "meta format": lambda out: (out / "criteo.json").write_text(
        json.dumps({"format": 2, "rows": 120, "table_sizes": SIZES})),
    "meta rows": lambda out: (out / "criteo.json").write_text(
        json.dumps({"format": 1, "rows": 119, "table_sizes": SIZES})),
    "meta sizes": lambda out: (out / "criteo.json").write_text(
        json.dumps({"format": 1, "rows": 120, "table_sizes": SIZES[:3]})),
    "meta keys": lambda out: (out / "criteo.json").write_text('{"format": 1}'),
    "label 7": _poke("labels", np.float32, 7.0),
    "dense negative": _poke("dense", np.float32, -1.0),
    "dense nan": _poke("dense", np.float32, np.nan),
    "index too large": _poke("sparse", np.int32, 10**6),
    "index negative": _poke("sparse", np.int32, -1),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_files_changed_after_conversion_are_refused_not_read(converted, damage):
    DAMAGE[damage](converted)
    before = sorted(p.relative_to(converted) for p in converted.rglob("*"))
    with pytest.raises(ValueError, match="convert_criteo again"):
        ds = C.CriteoDataset(converted, 4)
        list(ds)
    assert sorted(p.relative_to(converted) for p in converted.rglob("*")) == before


def test_a_missing_conversion_marker_says_the_conversion_did_not_finish(tmp_path, converted):
    (converted / "criteo.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a finished Criteo conversion"):
        C.CriteoDataset(converted, 4)
    with pytest.raises(FileNotFoundError, match="not a finished Criteo conversion"):
        C.CriteoDataset(tmp_path / "tiny.tsv", 4)


# --- dataset arguments and iteration --------------------------------------------------------


@pytest.mark.parametrize("batch_size, error", [
    (0, ValueError), (-3, ValueError), (2.5, TypeError), ("4", TypeError), (None, TypeError),
])
def test_criteo_batch_sizes_that_are_not_positive_integers_are_refused(converted, batch_size,
                                                                        error):
    with pytest.raises(error, match="batch_size"):
        C.CriteoDataset(converted, batch_size)


def test_a_batch_larger_than_the_data(converted):
    with pytest.raises(ValueError, match="larger than the 120 rows.*drop_last=False"):
        C.CriteoDataset(converted, 121)
    ds = C.CriteoDataset(converted, 1000, drop_last=False)
    assert len(ds) == 1 and ds.batch(0).labels.shape == (120,)


def test_criteo_batch_numbers_are_checked(converted):
    ds = C.CriteoDataset(converted, 10)
    for i, error in [(-1, IndexError), (12, IndexError), (1.5, TypeError), ("1", TypeError)]:
        with pytest.raises(error, match="batch"):
            ds.batch(i)
    assert _same_batches([ds.batch(np.int64(2))], [ds.batch(2)])


def _iterate_twice_and_from_two_threads(ds):
    first, second = list(ds), list(ds)
    assert len(first) == len(ds) and _same_batches(first, second)
    results = [None, None]

    def run(k):
        results[k] = list(ds)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(_same_batches(first, r) and len(r) == len(first) for r in results)


def test_criteo_iterates_twice_and_from_two_threads(converted):
    _iterate_twice_and_from_two_threads(C.CriteoDataset(converted, 7, drop_last=False))


@pytest.mark.parametrize("distribution", ["uniform", "zipf"])
def test_synthetic_iterates_twice_and_from_two_threads(distribution):
    _iterate_twice_and_from_two_threads(
        D.SyntheticDataset(3, [1, 40, 5000], 16, pooling=(0, 4), distribution=distribution,
                           num_batches=6))


@pytest.mark.parametrize("kwargs, error, what", [
    (dict(batch_size=0), ValueError, "batch_size"),
    (dict(batch_size=-1), ValueError, "batch_size"),
    (dict(batch_size=2.5), TypeError, "batch_size"),
    (dict(num_batches=-1), ValueError, "num_batches"),
    (dict(num_batches=1.5), TypeError, "num_batches"),
    (dict(num_dense=-1), ValueError, "num_dense"),
    (dict(table_sizes="123"), TypeError, "table_sizes"),
    (dict(table_sizes=13), TypeError, "table_sizes"),
    (dict(table_sizes=[10.5]), TypeError, "table size"),
    (dict(table_sizes=[0]), ValueError, "at least one row"),
    (dict(pooling=(1, 2, 3)), TypeError, "pooling"),
    (dict(pooling="3"), TypeError, "pooling"),
    (dict(pooling=None), TypeError, "pooling"),
    (dict(pooling=2.5), TypeError, "pooling"),
    (dict(pooling=(3, 1)), ValueError, "pooling"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
])
def test_synthetic_arguments_are_checked_by_name(kwargs, error, what):
    args = dict(num_dense=4, table_sizes=[10, 20], batch_size=8)
    args.update(kwargs)
    with pytest.raises(error, match=what):
        D.SyntheticDataset(**args)


def test_synthetic_batch_numbers_are_checked():
    ds = D.SyntheticDataset(4, [10], 8, num_batches=3)
    with pytest.raises(ValueError, match="batch number"):
        ds.batch(-1)
    with pytest.raises(TypeError, match="batch number"):
        ds.batch(1.5)
    assert _same_batches([ds.batch(10**6)], [ds.batch(10**6)])   # beyond num_batches: any i


@pytest.mark.parametrize("distribution", ["uniform", "zipf"])
@pytest.mark.parametrize("alpha", [0.0, 1.0, 50.0])
def test_one_row_tables_give_row_zero(distribution, alpha):
    ds = D.SyntheticDataset(2, [1, 1, 2], 32, pooling=(0, 5), distribution=distribution,
                            alpha=alpha, num_batches=2)
    for b in ds:
        for idx, off, n in zip(b.indices, b.offsets, ds.table_sizes):
            K.check_indices(idx, n)
            K.check_offsets(off, idx.size, 32)
        assert not b.indices[0].any() and not b.indices[1].any()


# --- dask.distributed serialization ---------------------------------------------------------

DTYPED = {
    "structured": np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i4"), ("b", "f8")]),
    "subarray field": np.arange(8, dtype=np.int32).view([("a", "i4", (2,))]),
    "titled fields": np.zeros(3, dtype={"names": ["a"], "formats": ["f4"], "titles": ["A"]}),
    "datetime": np.array(["2020-01-01", "2021-06-30"], dtype="M8[D]"),
    "timedelta": np.array([1, 2], dtype="m8[s]"),
    "empty": np.zeros((0, 3)),
    "0-d": np.array(3.5),
    "big-endian": np.arange(4, dtype=">i4"),
    "strings": np.array(["ab", "cde"]),
    "F order": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
}


@pytest.mark.parametrize("name", DTYPED, ids=list(DTYPED))
def test_a_chunk_of_any_dtype_travels_with_its_dtype_shape_and_bytes(name):
    pytest.importorskip("distributed")
    import cachedarrays as ca
    import cachedarrays.dask  # noqa: F401
    from distributed.protocol import deserialize, serialize
    a = DTYPED[name]
    with ca.Manager(fast="4MiB", slow="64MiB") as m:
        previous = ca.set_default_manager(m)
        try:
            x = ca.asarray(a, manager=m)
            header, frames = serialize(x, serializers=["dask"])
            assert header["serializer"] == "dask"
            y = deserialize(header, frames)
            del frames                     # lets go of the frame, so of x's pin
            assert isinstance(y, ca.CachedArray)
            with ca.readable(y) as v:
                assert v.dtype == a.dtype and v.shape == a.shape
                assert v.tobytes() == np.ascontiguousarray(a).tobytes()
        finally:
            ca.set_default_manager(previous)


def test_a_chunk_frame_of_the_wrong_size_is_refused():
    pytest.importorskip("distributed")
    import cachedarrays as ca
    from cachedarrays import dask as cd
    with ca.Manager(fast="4MiB", slow="64MiB") as m:
        previous = ca.set_default_manager(m)
        try:
            header, frames = cd._serialize(ca.asarray(np.arange(10.0), manager=m))
            with pytest.raises(ValueError, match="arrived with 72 bytes, not 80"):
                cd._deserialize(header, [bytes(frames[0])[:72]])
            del frames
        finally:
            ca.set_default_manager(previous)


def test_views_with_different_fields_get_different_tokens():
    pytest.importorskip("dask")
    import cachedarrays as ca
    import cachedarrays.dask  # noqa: F401
    from dask.base import tokenize
    with ca.Manager(fast="4MiB", slow="64MiB") as m:
        x = ca.asarray(np.zeros(4, dtype=[("a", "i4"), ("b", "f8")]), manager=m)
        y = x.view([("b", "i4"), ("a", "f8")])           # the same bytes, |V12 both
        z = x.view([("a", "i4"), ("b", "f8")])
        assert tokenize(x) != tokenize(y) and tokenize(x) == tokenize(z)


def test_gzip_is_recognised_by_its_bytes_not_its_name(tmp_path, tsv):
    import gzip
    want = list(C.read_criteo(tsv, SIZES))
    disguised = tmp_path / "plain.tsv"
    disguised.write_bytes(gzip.compress(tsv.read_bytes()))
    named = tmp_path / "named.tsv.gz"
    named.write_bytes(tsv.read_bytes())
    for src in (disguised, named):
        got = list(C.read_criteo(src, SIZES))
        assert all(np.array_equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))


def test_a_file_cut_short_while_the_dataset_is_open_raises(converted):
    ds = C.CriteoDataset(converted, 10)
    first = ds.batch(0)
    for name, row_bytes in (("labels", 4), ("dense", 4 * 13), ("sparse", 4 * 26)):
        os.truncate(converted / name / "data.ninja", 20 * row_bytes)     # 20 rows left
    assert _same_batches([first], [ds.batch(0)])
    with pytest.raises(ValueError, match="cut short.*convert_criteo again"):
        ds.batch(5)                                         # no SIGBUS


def test_a_dataset_pickles_as_its_arguments(converted):
    import pickle
    ds = C.CriteoDataset(converted, 8, table_sizes=SIZES, drop_last=False)
    blob = pickle.dumps(ds)
    assert len(blob) < 2000                                 # not the data
    again = pickle.loads(blob)
    assert len(again) == len(ds) == 15 and _same_batches(list(ds), list(again))


def test_zipf_sample_names_a_seed_given_for_a_generator_and_a_bad_size():
    from cachedarrays.models.dlrm import ZipfSampler
    z = ZipfSampler(100, 1.1)
    with pytest.raises(TypeError, match="takes a np.random.Generator, got int"):
        z.sample(7, 10)
    with pytest.raises(ValueError, match="size .* must be >= 0, got -1"):
        z.sample(np.random.default_rng(0), -1)
    with pytest.raises(TypeError, match="size .* must be an integer"):
        z.sample(np.random.default_rng(0), 2.5)
    got = z.sample(np.random.default_rng(0), 1000)
    assert got.shape == (1000,) and got.min() >= 0 and got.max() < 100
    assert z.sample(np.random.default_rng(0), 0).shape == (0,)
