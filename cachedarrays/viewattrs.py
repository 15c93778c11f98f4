"""The helper objects behind two array attributes: ``x.flat`` (FlatIter) and ``x.flags``
(Flags). Both go through the array for every access, so they survive migration."""

import numpy as np

from .pinning import plain_key, readable

FLAGS_FIXED = (
    "a CachedArray's flags cannot be set: each use builds a fresh view of wherever the data "
    "lives now; for read-only access use `with ca.readable(x) as a:`")


class FlatIter:
    """x.flat for a CachedArray: reads and writes go through x, so they survive migration.
    An iterator as NumPy's flatiter (``next``, ``index``, ``coords``), reading a chunk of
    elements at a time (a copy: nothing stays pinned between steps)."""

    __slots__ = ("base", "_chunk", "_index", "_rest")

    def __init__(self, base):
        self.base = base
        self._chunk = 1 << 14
        self._index = 0                 # the next element's flat index
        self._rest = iter(())           # an iterator over a copy of the elements from there on

    def __len__(self):
        return self.base.size

    def __getitem__(self, key):
        key = plain_key(key)
        base = self.base
        m, obj = base._m, base._obj
        m.acquire((obj,))
        try:
            r = base._view().flat[key]
            if type(r) is np.void:           # a record views the bytes, which can move
                return r.copy()
            return type(base)._copy_in(m, r) if isinstance(r, np.ndarray) else r
        finally:
            m.release((obj,))

    def __setitem__(self, key, value):
        key = plain_key(key)

        def put(v, x):
            v.flat[key] = x
        self.base._write(put, value)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            item = next(self._rest)
        except StopIteration:
            i = self._index
            if i >= self.base.size:
                raise
            with readable(self.base) as v:
                self._rest = iter(v.flat[i:i + self._chunk])   # a copy: nothing stays pinned
            item = next(self._rest)
        self._index += 1
        return item

    @property
    def index(self):
        """The flat index of the next element."""
        return self._index

    @property
    def coords(self):
        """The N-dimensional index of the next element (past the end: the first axis counts
        on, as NumPy's)."""
        shape = self.base.shape
        if 0 in shape:
            return (0,) * len(shape)
        i, coords = self._index, []
        for d in reversed(shape[1:]):
            i, c = divmod(i, d)
            coords.append(c)
        return (i,) + tuple(reversed(coords)) if shape else ()

    def __array__(self, dtype=None, copy=None):
        return self.base.ravel().__array__(dtype, copy)

    def copy(self):
        return self.base.flatten()

    def __repr__(self):
        return f"<flat iterator of {self.base!r}>"


class Flags:
    """x.flags for a CachedArray: ndarray's layout flags, read once; none can be set."""

    __slots__ = ("c_contiguous", "f_contiguous", "owndata", "writeable", "aligned",
                 "writebackifcopy")
    _KEYS = {"C": "c_contiguous", "C_CONTIGUOUS": "c_contiguous", "CONTIGUOUS": "c_contiguous",
             "F": "f_contiguous", "F_CONTIGUOUS": "f_contiguous", "FORTRAN": "f_contiguous",
             "O": "owndata", "OWNDATA": "owndata", "W": "writeable", "WRITEABLE": "writeable",
             "A": "aligned", "ALIGNED": "aligned", "X": "writebackifcopy",
             "WRITEBACKIFCOPY": "writebackifcopy", "FNC": "fnc", "FORC": "forc",
             "B": "behaved", "BEHAVED": "behaved", "CA": "carray", "CARRAY": "carray",
             "FA": "farray", "FARRAY": "farray"}

    def __init__(self, flags, owndata, writeable=True):
        set_ = object.__setattr__
        set_(self, "c_contiguous", flags.c_contiguous)
        set_(self, "f_contiguous", flags.f_contiguous)
        set_(self, "owndata", owndata)
        set_(self, "writeable", writeable)     # False only for views NumPy makes read-only
        set_(self, "aligned", flags.aligned)
        set_(self, "writebackifcopy", False)

    fnc = property(lambda self: self.f_contiguous and not self.c_contiguous)
    forc = property(lambda self: self.f_contiguous or self.c_contiguous)
    behaved = property(lambda self: self.aligned and self.writeable)
    carray = property(lambda self: self.behaved and self.c_contiguous)
    farray = property(lambda self: self.behaved and self.fnc)

    _SETTABLE = {"W": "writeable", "WRITEABLE": "writeable", "A": "aligned", "ALIGNED": "aligned",
                 "X": "writebackifcopy", "WRITEBACKIFCOPY": "writebackifcopy"}

    def __getitem__(self, key):
        name = self._KEYS.get(key) if isinstance(key, str) else None   # NumPy's spellings only
        if name is None:
            raise KeyError(f"unknown flag {key!r}")
        return getattr(self, name)

    def __setattr__(self, name, value):
        if name not in self._SETTABLE.values():        # as NumPy's: the layout is read-only
            getattr(self, name)                         # AttributeError for an unknown name
            raise AttributeError(f"attribute {name!r} of 'Flags' objects is not writable")
        if name == "writebackifcopy" and value:
            raise ValueError("cannot set WRITEBACKIFCOPY flag to True")
        if getattr(self, name) != value:
            raise TypeError(FLAGS_FIXED)

    def __setitem__(self, key, value):
        name = self._SETTABLE.get(key) if isinstance(key, str) else None
        if name is None:
            raise KeyError(f"unknown flag {key!r}, or one that cannot be set")
        setattr(self, name, value)

    def __eq__(self, other):
        names = ("c_contiguous", "f_contiguous", "owndata", "writeable", "aligned",
                 "writebackifcopy")
        return all(getattr(self, n) == getattr(other, n) for n in names)

    __hash__ = None

    def __repr__(self):
        return "\n".join(f"  {key} : {self[key]}" for key in
                         ("C_CONTIGUOUS", "F_CONTIGUOUS", "OWNDATA", "WRITEABLE", "ALIGNED",
                          "WRITEBACKIFCOPY"))
