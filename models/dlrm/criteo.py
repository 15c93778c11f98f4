"""Criteo Kaggle (DAC) click logs: streaming TSV reader, mmap-ninja converter, batch loader.

A line holds 40 tab-separated fields: the 0/1 label, 13 integer counts and 26 categorical
features as 8-hex-digit hashes; any field may be empty.  Counts become ``log(max(x, 0) + 1)``
(empty = 0); hashes become ``int(h, 16) % table_size`` (empty = 0).  No Criteo data ships
with this package: tests use :func:`write_tiny_criteo`.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import io
import json
import logging
import math
import os
import re
import string
import struct
import weakref
import zlib
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from mmap_ninja import numpy as np_ninja

from cachedarrays.copyengine import check_switch

from .data import Batch, _integer, _table_sizes

__all__ = [
    "NUM_DENSE",
    "NUM_SPARSE",
    "parse_line",
    "read_criteo",
    "convert_criteo",
    "CriteoDataset",
    "write_tiny_criteo",
]

log = logging.getLogger(__name__)

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_META = "criteo.json"
_FORMAT = 1
_ARRAYS = ("labels", "dense", "sparse")
_NINJA = ("data.ninja", "dtype.ninja", "shape.ninja", "order.ninja")
_LABELS = frozenset(("", "0", "1"))
_NOT_INT = str.maketrans("", "", string.digits + "-")
_NOT_HEX = str.maketrans("", "", string.hexdigits)
_INT = re.compile(r"-?[0-9]+")
_HEX = re.compile(r"[0-9a-fA-F]+")
_MAX_DIGITS = 300               # a count of more digits does not fit a float64


def _check_sizes(table_sizes) -> list:
    sizes = _table_sizes(table_sizes)
    if len(sizes) != NUM_SPARSE:
        raise ValueError(f"Criteo has {NUM_SPARSE} categorical features; got {len(sizes)} "
                         f"table sizes")
    return sizes


def _as_path(path, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path (str or os.PathLike), got {path!r}")
    return Path(path)


@contextlib.contextmanager
def _open_text(path) -> Iterator[io.TextIOBase]:
    """The file as text lines, gunzipped when it starts with gzip's magic bytes (whatever its
    name); bytes outside ASCII survive as surrogates, so the field checks name their line."""
    with open(_as_path(path, "src"), "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if raw.peek(2)[:2] == b"\x1f\x8b" else raw
        with io.TextIOWrapper(stream, encoding="ascii", errors="surrogateescape",
                              newline="\n") as text:
            yield text


def _split(line: str, where: str) -> list:
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != NUM_FIELDS:
        raise ValueError(f"{where}: expected {NUM_FIELDS} tab-separated fields "
                         f"(label, {NUM_DENSE} integers, {NUM_SPARSE} hashes), got {len(fields)}")
    return fields


def _field_error(where: str, k: int, value: str, want: str) -> ValueError:
    return ValueError(f"{where}: field {k + 1} is {value[:40]!r}; it must be {want} "
                      f"(fix or drop that line)")


def _check_fields(fields: list, where: str) -> None:
    """Raise a ValueError naming the first field that is not a Criteo label, count or hash."""
    if fields[0] not in _LABELS:
        raise _field_error(where, 0, fields[0], "the label 0 or 1, or empty")
    for k in range(1, 1 + NUM_DENSE):
        x = fields[k]
        if x and (not _INT.fullmatch(x) or len(x.lstrip("-")) > _MAX_DIGITS):
            raise _field_error(where, k, x, "an integer count of at most 300 digits, or empty")
    for k in range(1 + NUM_DENSE, NUM_FIELDS):
        if fields[k] and not _HEX.fullmatch(fields[k]):
            raise _field_error(where, k, fields[k], "a hexadecimal hash, or empty")


def parse_line(line: str, table_sizes: Sequence[int]):
    """One TSV line -> (label, dense float32 (13,), sparse int64 (26,)); the reference parser."""
    sizes = _check_sizes(table_sizes)
    fields = _split(line, "criteo line")
    _check_fields(fields, "criteo line")
    label = float(int(fields[0])) if fields[0] else 0.0
    counts = [max(int(x), 0) if x else 0 for x in fields[1:1 + NUM_DENSE]]
    dense = np.log1p(np.array(counts, dtype=np.float64)).astype(np.float32)
    sparse = np.empty(NUM_SPARSE, dtype=np.int64)
    for j in range(NUM_SPARSE):
        h = fields[1 + NUM_DENSE + j]
        sparse[j] = int(h, 16) % sizes[j] if h else 0
    return label, dense, sparse


def _chunk_is_clean(rows: list) -> bool:
    """A quick check of a whole chunk: labels 0/1/empty, counts of digits and '-', hex hashes."""
    if not {r[0] for r in rows} <= _LABELS:
        return False
    counts = "".join(x for r in rows for x in r[1:1 + NUM_DENSE])
    hashes = "".join(x for r in rows for x in r[1 + NUM_DENSE:])
    return not counts.translate(_NOT_INT) and not hashes.translate(_NOT_HEX)


def _parse_chunk(lines: list, sizes: list, numbers: list):
    """Parse a chunk of lines; on a malformed one, raise a ValueError naming its line number."""
    rows = [_split(line, f"line {no}") for line, no in zip(lines, numbers)]
    try:
        if _chunk_is_clean(rows):
            return _parse_rows(rows, sizes)
    except (ValueError, OverflowError):
        pass
    for r, no in zip(rows, numbers):
        _check_fields(r, f"line {no}")
    return _parse_rows(rows, sizes)


def _parse_rows(rows: list, sizes: list):
    """Checked rows of fields -> (labels, dense, sparse) arrays."""
    n = len(rows)
    labels = np.array([int(r[0]) if r[0] else 0 for r in rows], dtype=np.float32)
    counts = np.array([[int(x) if x else 0 for x in r[1:1 + NUM_DENSE]] for r in rows],
                      dtype=np.float64).reshape(n, NUM_DENSE)
    dense = np.log1p(np.maximum(counts, 0.0)).astype(np.float32)
    sparse = np.empty((n, NUM_SPARSE), dtype=np.int64)
    for j in range(NUM_SPARSE):
        m = sizes[j]
        sparse[:, j] = [int(r[1 + NUM_DENSE + j], 16) % m if r[1 + NUM_DENSE + j] else 0
                        for r in rows]
    return labels, dense, sparse


def read_criteo(path, table_sizes: Sequence[int], chunk_rows: int = 65536) -> Iterator[tuple]:
    """Stream a Criteo TSV (gzipped or not) as chunks ``(labels f32 (n,), dense f32 (n,13),
    sparse i64 (n,26))`` of at most ``chunk_rows`` rows; memory use is bounded by one chunk.
    A malformed line raises a ValueError naming its line number and field."""
    sizes = _check_sizes(table_sizes)
    chunk_rows = _integer(chunk_rows, "chunk_rows", 1)
    with _open_text(path) as f:
        lines, numbers = [], []
        for no, line in _numbered_lines(f, path):
            lines.append(line)
            numbers.append(no)
            if len(lines) == chunk_rows:
                yield _parse_chunk(lines, sizes, numbers)
                lines, numbers = [], []
        if lines:
            yield _parse_chunk(lines, sizes, numbers)


def _numbered_lines(f, path) -> Iterator[tuple]:
    """(line number, line) of every line that holds more than spaces and a line end."""
    try:
        for no, line in enumerate(f, 1):
            if line.rstrip("\r\n").strip(" "):
                yield no, line
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(f"{path}: the gzip stream is truncated or damaged ({e}); compress "
                         f"the TSV again or pass it uncompressed") from e


def convert_criteo(src, out_dir, table_sizes: Sequence[int], chunk_rows: int = 65536) -> int:
    """Convert a Criteo TSV into mmap-ninja arrays ``dense`` (N,13) f32, ``sparse`` (N,26)
    int32 (already reduced modulo each table size), ``labels`` (N,) f32.  Returns N.

    ``criteo.json`` marks a finished conversion; it is removed before the first array is
    written and written (atomically) after the last, so an interrupted or failed conversion
    leaves a directory :class:`CriteoDataset` refuses (a source that cannot be read, or whose
    first chunk is malformed, leaves a previous conversion as it was).  The arrays are written
    to new files, so datasets already open on ``out_dir`` keep reading the old ones; a second
    conversion into the same ``out_dir`` at the same time raises ``BlockingIOError``."""
    sizes = _check_sizes(table_sizes)
    out = _output_dir(out_dir)
    with _conversion_lock(out):
        return _convert(src, out, sizes, chunk_rows)


def _convert(src, out: Path, sizes: list, chunk_rows: int) -> int:
    """Write the arrays chunk by chunk, then the metadata; returns the row count."""
    sparse_dtype = np.int32 if max(sizes) <= 2**31 else np.int64
    nrows = 0
    for labels, dense, sparse in read_criteo(src, sizes, chunk_rows):
        parts = {"labels": labels, "dense": dense, "sparse": sparse.astype(sparse_dtype)}
        if nrows == 0:
            _start_conversion(out)
        for name, arr in parts.items():
            if nrows == 0:
                mm = np_ninja.from_ndarray(out / name, arr)
                mm.flush()
                del mm
            else:
                np_ninja.extend_dir(out / name, arr)
        nrows += labels.shape[0]
        log.debug("converted %d rows of %s", nrows, src)
    if nrows == 0:
        raise ValueError(f"{src}: no Criteo rows to convert")
    meta = {"format": _FORMAT, "rows": nrows, "table_sizes": sizes}
    tmp = out / (_META + ".tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, out / _META)
    log.info("converted %d Criteo rows from %s into %s", nrows, src, out)
    return nrows


def _output_dir(out_dir) -> Path:
    """``out_dir`` as a writable directory (created when missing)."""
    out = _as_path(out_dir, "out_dir")
    if out.is_symlink() and not out.exists():
        raise FileNotFoundError(f"out_dir {out} is a symbolic link to a missing "
                                f"{os.readlink(out)}; create that directory or pass another one")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {out} exists and is not a directory; pass a directory "
                                 f"(convert_criteo creates it when missing)")
    for name in _ARRAYS:
        part = out / name
        if part.is_symlink():
            raise ValueError(f"{part} is a symbolic link (to {os.readlink(part)}); "
                             f"convert_criteo writes and deletes the {name} array's files "
                             f"there: remove the link or pass another out_dir")
        if (part.exists() or part.is_symlink()) and not part.is_dir():
            raise NotADirectoryError(f"{part} exists and is not a directory; convert_criteo "
                                     f"writes the {name} array there: move it away")
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK | os.X_OK):
        raise PermissionError(f"out_dir {out} is not writable; pass a writable directory")
    return out


class _conversion_lock:
    """An exclusive lock on ``out_dir`` for one conversion (two would mix their rows)."""

    def __init__(self, out: Path):
        self.path = out / (_META + ".lock")

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise BlockingIOError(f"another convert_criteo is writing into {self.path.parent}; "
                                  f"wait for it to finish or pass another out_dir") from None
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def _start_conversion(out: Path) -> None:
    """Mark ``out`` unfinished and unlink the previous arrays' files: memory maps of them
    (an open CriteoDataset) keep the old data instead of reading a file cut short."""
    (out / _META).unlink(missing_ok=True)
    for name in _ARRAYS:
        for f in _NINJA + ("type.ninja",):
            (out / name / f).unlink(missing_ok=True)


class CriteoDataset:
    """Batches of a converted Criteo directory in the :class:`~.data.Batch` format (one index
    per bag per table).  Reads through memory maps; ``drop_last`` drops a partial last batch.

    The arrays' files are checked against ``criteo.json`` when the dataset opens, and every
    batch's labels, counts and indices when it is read, so files changed after the
    conversion raise a ValueError instead of giving wrong data.  Batches are copied out of the
    files with pread (a file cut short while the dataset is open raises a ValueError too);
    ``labels``, ``dense`` and ``sparse`` are read-only memory maps of the whole arrays."""

    def __init__(self, path, batch_size: int, table_sizes: Sequence[int] | None = None,
                 drop_last: bool = True):
        drop_last = check_switch(drop_last, "CriteoDataset: drop_last")
        self.path = _as_path(path, "path")
        meta = _read_meta(self.path)
        self.table_sizes = meta["table_sizes"]
        if table_sizes is not None:
            want = _check_sizes(table_sizes)
            for t, (have, need) in enumerate(zip(self.table_sizes, want)):
                if have != need:
                    raise ValueError(f"table {t}: {self.path} was hashed into {have} rows but "
                                     f"{need} were requested; convert again with these sizes")
        self.batch_size = _integer(batch_size, "batch_size", 1)
        self.drop_last = drop_last
        self.rows = meta["rows"]
        if self.drop_last and self.rows < self.batch_size:
            raise ValueError(f"batch_size {self.batch_size} is larger than the {self.rows} rows "
                             f"of {self.path}, so drop_last=True leaves no batch; pass a "
                             f"smaller batch_size or drop_last=False")
        int_dtypes = (np.dtype(np.int32), np.dtype(np.int64))
        self.labels = _open_array(self.path, "labels", (np.dtype(np.float32),), (), self.rows)
        self.dense = _open_array(self.path, "dense", (np.dtype(np.float32),), (NUM_DENSE,),
                                 self.rows)
        self.sparse = _open_array(self.path, "sparse", int_dtypes, (NUM_SPARSE,), self.rows)
        self._sizes = np.array(self.table_sizes, dtype=np.int64)
        self._readers = {name: _RowReader(self.path / name, getattr(self, name))
                         for name in _ARRAYS}

    def __reduce__(self):
        """Pickles as its arguments (another process opens the files again), not its data."""
        return (type(self), (self.path, self.batch_size, self.table_sizes, self.drop_last))

    def __len__(self) -> int:
        if self.drop_last:
            return self.rows // self.batch_size
        return math.ceil(self.rows / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for i in range(len(self)):
            yield self.batch(i)

    def batch(self, i: int) -> Batch:
        """Batch i: rows ``i * batch_size`` up to the next batch (copied out of the maps)."""
        i = _integer(i, "the batch number")
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} out of range; {self.path} has {len(self)} batches")
        lo = i * self.batch_size
        hi = min(self.rows, lo + self.batch_size)
        labels, dense, sparse = (self._readers[name].read(lo, hi) for name in _ARRAYS)
        self._check_batch(i, labels, dense, sparse)
        offsets = np.arange(hi - lo, dtype=np.int64)
        return Batch(
            dense=dense,
            indices=[np.ascontiguousarray(sparse[:, t], dtype=np.int64) for t in range(NUM_SPARSE)],
            offsets=[offsets] * NUM_SPARSE,
            labels=labels,
        )

    def _check_batch(self, i: int, labels, dense, sparse) -> None:
        """Refuse values no conversion writes (the files were changed since)."""
        if not ((labels == 0) | (labels == 1)).all():
            bad = "labels other than 0 and 1"
        elif not ((dense >= 0) & (dense < np.inf)).all():
            bad = "negative or non-finite dense features"
        elif not ((sparse >= 0) & (sparse < self._sizes)).all():
            bad = "indices outside their tables"
        else:
            return
        raise ValueError(f"{self.path}: batch {i} holds {bad}; the files were changed after "
                         f"the conversion: run convert_criteo again")


class _RowReader:
    """Copies rows of one converted array out of its file with pread, so a file cut short
    after the dataset opened raises a ValueError (reading its memory map would SIGBUS)."""

    def __init__(self, where: Path, mm: np.memmap):
        self.where = where
        self.dtype, self.tail = mm.dtype, mm.shape[1:]
        self.row_bytes = mm.itemsize * math.prod(self.tail)
        self.fd = os.open(where / "data.ninja", os.O_RDONLY | os.O_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)

    def read(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty((hi - lo, *self.tail), dtype=self.dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        done, offset = 0, lo * self.row_bytes
        while done < len(buf):
            n = os.preadv(self.fd, [buf[done:]], offset + done)
            if n == 0:
                raise _damaged(self.where, f"data.ninja was cut short to "
                                           f"{os.fstat(self.fd).st_size} bytes while the dataset "
                                           f"was open")
            done += n
        return out


def _damaged(path: Path, what: str) -> ValueError:
    return ValueError(f"{path} is damaged or was changed after the conversion ({what}); run "
                      f"convert_criteo again")


def _read_meta(path: Path) -> dict:
    """criteo.json of a finished conversion, checked: format, row count and table sizes."""
    meta_file = path / _META
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a finished Criteo conversion ({_META} is "
                                f"missing: a conversion never ran there, failed or was "
                                f"interrupted); run convert_criteo first")
    try:
        meta = json.loads(meta_file.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise _damaged(meta_file, f"unreadable: {e}") from e
    if meta.get("format") != _FORMAT:
        raise _damaged(meta_file, f"format {meta.get('format')!r}, this version reads "
                                  f"format {_FORMAT}")
    try:
        rows = _integer(meta.get("rows"), "rows", 1)
        sizes = _check_sizes(meta.get("table_sizes"))
    except (TypeError, ValueError) as e:
        raise _damaged(meta_file, str(e)) from e
    return {"rows": rows, "table_sizes": sizes}


def _open_array(path: Path, name: str, dtypes: tuple, tail: tuple, rows: int) -> np.memmap:
    """The array ``name`` of a conversion, read-only, checked against what was written."""
    where = path / name
    missing = [f for f in _NINJA if not (where / f).is_file()]
    if missing:
        raise _damaged(where, f"{', '.join(missing)} missing")
    try:
        mm = np_ninja.open_existing(where, mode="r")
    except (ValueError, TypeError, OSError, struct.error) as e:
        raise _damaged(where, f"cannot map it: {e}") from e
    want = f"({rows}{''.join(f', {n}' for n in tail)}{',' if not tail else ''}) " \
           f"{' or '.join(d.name for d in dtypes)} in C order"
    if mm.dtype not in dtypes or mm.shape != (rows, *tail) or not mm.flags.c_contiguous:
        raise _damaged(where, f"holds {mm.shape} {mm.dtype.name}, expected {want}")
    size = os.path.getsize(where / "data.ninja")
    if size != mm.nbytes:
        raise _damaged(where, f"data.ninja has {size} bytes, expected {mm.nbytes}")
    return mm


def write_tiny_criteo(path, nrows: int = 200, seed: int = 0) -> Path:
    """Write a synthetic file in Criteo's TSV format (blank fields, negative counts, 8-digit
    hex hashes) for tests; it contains no Criteo data."""
    rng = np.random.default_rng(seed)
    vocab = [rng.integers(0, 2**32, size=int(rng.integers(3, 40)), dtype=np.uint64)
             for _ in range(NUM_SPARSE)]
    path = Path(path)
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for _ in range(nrows):
            fields = [str(int(rng.random() < 0.25))]
            for _ in range(NUM_DENSE):
                u = rng.random()
                if u < 0.12:
                    fields.append("")
                elif u < 0.15:
                    fields.append(str(-int(rng.integers(1, 4))))
                else:
                    fields.append(str(int(rng.geometric(0.05)) - 1))
            for j in range(NUM_SPARSE):
                if rng.random() < 0.1:
                    fields.append("")
                else:
                    k = min(int(rng.zipf(1.5)) - 1, len(vocab[j]) - 1)
                    fields.append(f"{int(vocab[j][k]):08x}")
            f.write("\t".join(fields) + "\n")
    return path
