"""Devices: where a heap's memory comes from (anonymous DRAM, a DAX file or device, a plain file).

A device owns one mapping and the native heap over it. Data is reached through ``device.buffer``
(a Python buffer over the mapping) and an offset, never through a raw pointer held by callers.
"""

import errno
import logging
import mmap
import os
import stat
import tempfile

from . import copyengine
from .errors import DeviceError, OutOfMemoryError
from .heap import Heap
from .sizes import format_size, parse_size

log = logging.getLogger("cachedarrays.devices")

MAP_SHARED_VALIDATE = 0x03
MAP_SYNC = 0x80000
_reported_not_dax = set()


def _mount_options(path):
    """Return the mount options (per-mount and superblock) of the file system holding path."""
    path = os.path.realpath(path)
    best, options = "", set()
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 6:
                    continue
                mount_point = fields[4].replace("\\040", " ")
                if (path == mount_point or path.startswith(mount_point.rstrip("/") + "/")) and len(
                    mount_point
                ) >= len(best):
                    best = mount_point
                    super_opts = right.split()[2] if len(right.split()) > 2 else ""
                    options = set(fields[5].split(",")) | set(super_opts.split(","))
    except OSError:
        pass
    return options


def is_dax(path):
    """True if path is a devdax character device or lies on a file system mounted with dax."""
    try:
        if stat.S_ISCHR(os.stat(path).st_mode):
            return True
    except OSError:
        pass
    probe = path if os.path.exists(path) else os.path.dirname(os.path.abspath(path))
    opts = _mount_options(probe)
    return any(o == "dax" or o.startswith("dax=") and o != "dax=never" for o in opts)


class Device:
    """A source of memory with its own heap. Subclasses create the mapping."""

    __ca_leaf__ = True

    kind = "device"

    def __init__(self, name, size, granularity=0):
        self.name = name
        self.size = parse_size(size, f"size of device {name!r}")
        self.granularity = granularity
        self.dax = False
        self.path = None
        self._mm = None
        self._base = None
        self.heap = None
        self.capacity = 0
        self.closed = False

    def _attach(self, mm):
        """Take ownership of a mapping and build the heap over it."""
        from ._native import ffi

        self._mm = mm
        self._base = ffi.from_buffer(mm)
        self.address = int(ffi.cast("uintptr_t", self._base))
        self.heap = Heap(self.address, self.size, self.granularity)
        self.capacity = self.heap.stats().capacity

    @property
    def buffer(self):
        """The Python buffer over the whole mapping (for building ndarray views)."""
        if self._mm is None:
            raise DeviceError(f"device {self.name!r} has no memory (size 0 or closed)")
        return self._mm

    # Heap operations: a size-0 device has no heap and every allocation fails.

    def alloc(self, nbytes, owner):
        """Allocate a block; raise OutOfMemoryError (naming this device) when it does not fit."""
        if self.heap is None:
            raise OutOfMemoryError(
                f"device {self.name!r} has no memory (size {format_size(self.size)}): cannot place "
                f"{format_size(nbytes)}; give it a size, or let the policy use another device"
            )
        try:
            return self.heap.alloc(nbytes, owner)
        except OutOfMemoryError as e:
            raise OutOfMemoryError(f"device {self.name!r}: {e}") from None

    def try_alloc(self, nbytes, owner):
        """Allocate a block, or return None when it does not fit (the cheap path)."""
        heap = self.heap
        return None if heap is None else heap.try_alloc(nbytes, owner)

    def can_alloc(self, nbytes):
        return self.heap is not None and self.heap.can_alloc(nbytes)

    def block_size(self, nbytes):
        if self.heap is None:
            return nbytes + 64
        return self.heap.block_size(nbytes)

    def fits(self, nbytes):
        """Could a block of nbytes ever fit on this device (empty heap)?"""
        return self.heap is not None and self.heap.block_size(nbytes) <= self.capacity

    def free(self, offset, owner):
        if self.heap is None:
            raise OutOfMemoryError(f"device {self.name!r} has no heap (size 0 or closed)")
        self.heap.free(offset, owner)

    def stats(self):
        if self.heap is None:
            return {"capacity": 0, "used": 0, "free": 0, "largest_free": 0,
                    "nblocks": 0, "nallocated": 0}
        s = self.heap.stats()
        return {k: getattr(s, k) for k in ("capacity", "used", "free", "largest_free",
                                            "nblocks", "nallocated")}

    def close(self):
        """Release the heap and the mapping; arrays still viewing it keep it alive until freed."""
        if self.closed:
            return
        self.closed = True
        if self.heap is not None:
            self.heap.close()
            self.heap = None
        if self._base is not None:
            from ._native import ffi

            ffi.release(self._base)
            self._base = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # ndarray views still refer to it: the mapping goes when the last one does.
                pass
            self._mm = None
        self._cleanup_file()

    def _cleanup_file(self):
        pass

    def __repr__(self):
        where = f" path={self.path!r}" if self.path else ""
        return f"<{type(self).__name__} {self.name!r} {format_size(self.size)}{where}>"


class DRAM(Device):
    """Anonymous memory: the fast device. Options: pre-fault, transparent huge pages, NUMA node."""

    kind = "dram"

    def __init__(self, size, name="fast", populate=False, hugepages=True, numa_node=None,
                 granularity=0):
        super().__init__(name, size, granularity)
        if self.size == 0:
            return
        if numa_node is not None:
            _check_numa_node(numa_node)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if populate and numa_node is None:
            flags |= mmap.MAP_POPULATE
        try:
            mm = mmap.mmap(-1, self.size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise DeviceError(
                f"cannot map {format_size(self.size)} of DRAM for device {name!r}: {e.strerror}; "
                "ask for less fast memory"
            ) from None
        if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                log.info("transparent huge pages are not available for device %r", name)
        if numa_node is not None:
            from ._native import ffi

            buf = ffi.from_buffer(mm)
            try:
                copyengine.mbind(int(ffi.cast("uintptr_t", buf)), self.size, numa_node)
            except OSError as e:
                ffi.release(buf)
                mm.close()
                raise DeviceError(
                    f"cannot bind device {name!r} ({format_size(self.size)}) to NUMA node "
                    f"{numa_node}: {e.strerror}; pick a node listed in /sys/devices/system/node"
                ) from None
            ffi.release(buf)
            if populate:
                _prefault(mm)
        self._attach(mm)


def _check_numa_node(node):
    base = "/sys/devices/system/node"
    nodes = sorted(int(d[4:]) for d in os.listdir(base) if d.startswith("node") and
                   d[4:].isdigit()) if os.path.isdir(base) else [0]
    if node not in nodes:
        raise DeviceError(f"NUMA node {node} does not exist on this machine; nodes are {nodes}")


def _prefault(mm):
    page = mmap.PAGESIZE
    for off in range(0, len(mm), page):
        mm[off] = mm[off]


class SlowDevice(Device):
    """The slow device: a devdax device, a file on a DAX file system, or a plain file.

    ``path=None`` (the embedded default) maps a private temporary file (mode 0600) that is removed
    at once, so nothing is left behind. A directory gets a temporary file inside it, removed the
    same way. Any other path names a file that is created (or reused) and kept.
    """

    kind = "slow"

    def __init__(self, size, path=None, name="slow", populate=False, granularity=0):
        super().__init__(name, size, granularity)
        self._unlink = None
        if self.size == 0:
            return
        fd, self.path, self._unlink, chardev = self._open(path)
        try:
            self.dax = is_dax(self.path)
            if not chardev:
                self._reserve(fd)
            mm = self._map(fd, populate)
        except BaseException:
            os.close(fd)
            self._cleanup_file()
            raise
        os.close(fd)
        if self._unlink:
            # The mapping keeps the file alive; removing the name now leaves nothing behind.
            self._cleanup_file()
        if not self.dax:
            shown = self.path if path is not None else "a temporary file"
            if shown not in _reported_not_dax:
                _reported_not_dax.add(shown)
                level = logging.INFO if path is None else logging.WARNING
                log.log(level, "slow device %r on %s is not DAX: the OS page cache serves this "
                        "device", name, shown)
        self._attach(mm)

    def _open(self, path):
        size = format_size(self.size)
        if path is None or os.path.isdir(path):
            directory = tempfile.gettempdir() if path is None else path
            if not os.access(directory, os.W_OK | os.X_OK):
                raise DeviceError(
                    f"cannot create the slow device ({size}) in {directory!r}: the directory is "
                    "not writable; pass slow_path= a writable directory or file"
                )
            try:
                fd, name = tempfile.mkstemp(prefix="cachedarrays-", suffix=".heap", dir=directory)
            except OSError as e:
                raise DeviceError(
                    f"cannot create a file for the slow device ({size}) in {directory!r}: "
                    f"{e.strerror}; pass slow_path= a writable directory"
                ) from None
            return fd, name, True, False
        path = os.path.abspath(os.fspath(path))
        if os.path.exists(path) and stat.S_ISCHR(os.stat(path).st_mode):
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as e:
                raise DeviceError(f"cannot open devdax device {path!r} for the slow device "
                                  f"({size}): {e.strerror}; check its permissions") from None
            return fd, path, False, True
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise DeviceError(f"cannot create slow device file {path!r} ({size}): the directory "
                              f"{parent!r} does not exist; create it or choose another path")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise DeviceError(f"cannot open slow device file {path!r} ({size}): {e.strerror}; "
                              "choose a writable path") from None
        return fd, path, False, False

    def _reserve(self, fd):
        """Make sure the file system has room before mapping, so later writes cannot fault."""
        have = os.fstat(fd).st_size
        need = max(0, self.size - have)
        st = os.fstatvfs(fd)
        avail = st.f_bavail * st.f_frsize
        if need > avail:
            raise DeviceError(
                f"not enough room for the slow device at {self.path!r}: it needs "
                f"{format_size(self.size)} but the file system has {format_size(avail)} free; "
                "choose a smaller slow size or a slow_path on a larger file system"
            )
        try:
            os.posix_fallocate(fd, 0, self.size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DeviceError(
                    f"not enough room for the slow device at {self.path!r} "
                    f"({format_size(self.size)}); choose a smaller size or another path"
                ) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise DeviceError(f"cannot size slow device file {self.path!r} to "
                                  f"{format_size(self.size)}: {e.strerror}") from None
            os.ftruncate(fd, max(have, self.size))

    def _map(self, fd, populate):
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        base = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        if self.dax:
            try:
                return mmap.mmap(fd, self.size, flags=base | MAP_SHARED_VALIDATE | MAP_SYNC,
                                 prot=prot)
            except OSError:
                log.info("MAP_SYNC is not supported for %r; mapping without it", self.path)
        try:
            return mmap.mmap(fd, self.size, flags=base, prot=prot)
        except (OSError, ValueError) as e:
            raise DeviceError(
                f"cannot map {format_size(self.size)} of {self.path!r} for the slow device: "
                f"{getattr(e, 'strerror', None) or e}; check the size against the file or device"
            ) from None

    def _cleanup_file(self):
        if self._unlink and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._unlink = None
