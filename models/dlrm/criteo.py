"""Criteo Kaggle (DAC) click logs: streaming TSV reader, mmap-ninja converter, batch loader.

A line holds 40 tab-separated fields: the 0/1 label, 13 integer counts and 26 categorical
features as 8-hex-digit hashes; any field may be empty.  Counts become ``log(max(x, 0) + 1)``
(empty = 0); hashes become ``int(h, 16) % table_size`` (empty = 0).  No Criteo data ships
with this package: tests use :func:`write_tiny_criteo`.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from mmap_ninja import numpy as np_ninja

from .data import Batch

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


def _check_sizes(table_sizes) -> list:
    sizes = [int(n) for n in table_sizes]
    if len(sizes) != NUM_SPARSE:
        raise ValueError(f"Criteo has {NUM_SPARSE} categorical features; got {len(sizes)} "
                         f"table sizes")
    bad = [t for t, n in enumerate(sizes) if n < 1]
    if bad:
        raise ValueError(f"table {bad[0]} has size {sizes[bad[0]]}; every table needs >= 1 row")
    return sizes


def _open_text(path) -> io.TextIOBase:
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="ascii", newline="\n")
    return open(path, "r", encoding="ascii", newline="\n")


def _split(line: str, where: str) -> list:
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != NUM_FIELDS:
        raise ValueError(f"{where}: expected {NUM_FIELDS} tab-separated fields "
                         f"(label, {NUM_DENSE} integers, {NUM_SPARSE} hashes), got {len(fields)}")
    return fields


def parse_line(line: str, table_sizes: Sequence[int]):
    """One TSV line -> (label, dense float32 (13,), sparse int64 (26,)); the reference parser."""
    sizes = _check_sizes(table_sizes)
    fields = _split(line, "criteo line")
    label = float(int(fields[0])) if fields[0] else 0.0
    counts = [max(int(x), 0) if x else 0 for x in fields[1:1 + NUM_DENSE]]
    dense = np.log1p(np.array(counts, dtype=np.float64)).astype(np.float32)
    sparse = np.empty(NUM_SPARSE, dtype=np.int64)
    for j in range(NUM_SPARSE):
        h = fields[1 + NUM_DENSE + j]
        sparse[j] = int(h, 16) % sizes[j] if h else 0
    return label, dense, sparse


def _parse_chunk(lines: list, sizes: list, first_line: int):
    n = len(lines)
    rows = [_split(line, f"line {first_line + i + 1}") for i, line in enumerate(lines)]
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
    """Stream a Criteo TSV (or .gz) as chunks ``(labels f32 (n,), dense f32 (n,13), sparse
    i64 (n,26))`` of at most ``chunk_rows`` rows; memory use is bounded by one chunk."""
    sizes = _check_sizes(table_sizes)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    with _open_text(path) as f:
        lines, done = [], 0
        for line in f:
            if not line.strip():
                continue
            lines.append(line)
            if len(lines) == chunk_rows:
                yield _parse_chunk(lines, sizes, done)
                done += len(lines)
                lines = []
        if lines:
            yield _parse_chunk(lines, sizes, done)


def convert_criteo(src, out_dir, table_sizes: Sequence[int], chunk_rows: int = 65536) -> int:
    """Convert a Criteo TSV into mmap-ninja arrays ``dense`` (N,13) f32, ``sparse`` (N,26)
    int32 (already reduced modulo each table size), ``labels`` (N,) f32.  Returns N."""
    sizes = _check_sizes(table_sizes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / _META).unlink(missing_ok=True)  # present only once a conversion has finished
    sparse_dtype = np.int32 if max(sizes) <= 2**31 else np.int64
    nrows = 0
    for labels, dense, sparse in read_criteo(src, sizes, chunk_rows):
        parts = {"labels": labels, "dense": dense, "sparse": sparse.astype(sparse_dtype)}
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
    (out / _META).write_text(json.dumps(meta))
    log.info("converted %d Criteo rows from %s into %s", nrows, src, out)
    return nrows


class CriteoDataset:
    """Batches of a converted Criteo directory in the :class:`~.data.Batch` format (one index
    per bag per table).  Reads through memory maps; ``drop_last`` drops a partial last batch."""

    def __init__(self, path, batch_size: int, table_sizes: Sequence[int] | None = None,
                 drop_last: bool = True):
        self.path = Path(path)
        meta_file = self.path / _META
        if not meta_file.exists():
            raise FileNotFoundError(f"{self.path} is not a finished Criteo conversion "
                                    f"({_META} is missing); run convert_criteo first")
        meta = json.loads(meta_file.read_text())
        self.table_sizes = meta["table_sizes"]
        if table_sizes is not None:
            want = _check_sizes(table_sizes)
            for t, (have, need) in enumerate(zip(self.table_sizes, want)):
                if have != need:
                    raise ValueError(f"table {t}: {self.path} was hashed into {have} rows but "
                                     f"{need} were requested; convert again with these sizes")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.labels = np_ninja.open_existing(self.path / "labels")
        self.dense = np_ninja.open_existing(self.path / "dense")
        self.sparse = np_ninja.open_existing(self.path / "sparse")
        self.rows = int(meta["rows"])
        if not (self.labels.shape[0] == self.dense.shape[0] == self.sparse.shape[0] == self.rows):
            raise ValueError(f"{self.path}: arrays disagree on the row count "
                             f"({self.labels.shape[0]}, {self.dense.shape[0]}, "
                             f"{self.sparse.shape[0]}; metadata says {self.rows})")

    def __len__(self) -> int:
        if self.drop_last:
            return self.rows // self.batch_size
        return math.ceil(self.rows / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for i in range(len(self)):
            yield self.batch(i)

    def batch(self, i: int) -> Batch:
        """Batch i: rows ``i * batch_size`` up to the next batch (copied out of the maps)."""
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} out of range; {self.path} has {len(self)} batches")
        lo = i * self.batch_size
        hi = min(self.rows, lo + self.batch_size)
        sparse = np.asarray(self.sparse[lo:hi])
        offsets = np.arange(hi - lo, dtype=np.int64)
        return Batch(
            dense=np.array(self.dense[lo:hi], dtype=np.float32),
            indices=[np.ascontiguousarray(sparse[:, t], dtype=np.int64) for t in range(NUM_SPARSE)],
            offsets=[offsets] * NUM_SPARSE,
            labels=np.array(self.labels[lo:hi], dtype=np.float32),
        )


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
