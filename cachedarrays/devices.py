"""Devices: where a heap's memory comes from (anonymous DRAM, a DAX file or device, a plain file).

A device owns one mapping and the native heap over it. Data is reached through ``device.buffer``
(a Python buffer over the mapping) and an offset, never through a raw pointer held by callers.
"""

import errno
import fcntl
import logging
import mmap
import operator
import os
import re
import stat
import tempfile
import weakref

from . import copyengine
from ._records import DeviceRecord
from .errors import DeviceError, OutOfMemoryError
from .heap import Heap
from .sizes import format_size, parse_size

log = logging.getLogger("cachedarrays.devices")

MAP_SHARED_VALIDATE = 0x03
MAP_SYNC = 0x80000
_SYSFS = "/sys"
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
                # mountinfo writes space, tab, newline and backslash in paths as octal escapes
                mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
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
    """True if path is a devdax device or lies on a file system mounted with dax.

    A character device counts only when the kernel lists it as DAX (``/dev/zero`` does not).
    """
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and stat.S_ISCHR(st.st_mode):
        return _is_devdax(st)
    probe = path if st is not None else os.path.dirname(os.path.abspath(path))
    opts = _mount_options(probe)
    return any(o == "dax" or o.startswith("dax=") and o != "dax=never" for o in opts)


def _sysfs_char(st):
    """The sysfs node of the character device st describes."""
    return os.path.join(_SYSFS, "dev", "char", f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")


def _is_devdax(st):
    """True if the kernel says the character device st describes is a DAX device (devdax)."""
    if not stat.S_ISCHR(st.st_mode):
        return False
    node = _sysfs_char(st)
    if not os.path.isdir(node):
        return False
    # the subsystem is bus/dax (or class/dax on kernels with the compatibility layout)
    if os.path.basename(os.path.realpath(os.path.join(node, "subsystem"))) == "dax":
        return True
    name = os.path.basename(os.path.realpath(node))
    return os.path.exists(os.path.join(_SYSFS, "bus", "dax", "devices", name))


def _devdax_size(st):
    """The capacity in bytes the kernel reports for a devdax device, or None if it is not known."""
    try:
        with open(os.path.join(_sysfs_char(st), "size")) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Device(DeviceRecord):
    """A source of memory with its own heap. Subclasses create the mapping."""

    kind = "device"
    virtual = False                   # True: a heap without data (replay): copies move no bytes
    _ro = None                        # read-only byte array over the mapping, built on first use
    _owner = None                     # weak reference to the manager using it

    def __init__(self, name, size, granularity=0):
        self.name = name
        self.size = parse_size(size, f"size of device {name!r}")
        self.granularity = _whole(granularity, "granularity", "a power of two >= 64, or 0 for "
                                  "the default")
        self.dax = False
        self.path = None
        self._mm = None
        self._base = None
        self.heap = None
        self.capacity = 0
        self.closed = False
        self.profile = None           # cost-model profile name (costmodel.PROFILES), if known
        self._pid = os.getpid()       # a forked child shares the memory: it makes its own

    def _attach(self, mm):
        """Take ownership of a mapping and build the heap over it."""
        from ._native import ffi

        self._mm = mm
        self._base = ffi.from_buffer(mm)
        self.address = int(ffi.cast("uintptr_t", self._base))
        try:
            self.heap = Heap(self.address, self.size, self.granularity, name=self.name)
        except BaseException as e:
            ffi.release(self._base)               # nothing else maps it yet: unmap it now
            self._base = self._mm = None
            mm.close()
            if isinstance(e, ValueError):
                raise ValueError(f"device {self.name!r} ({format_size(self.size)}): {e}") from None
            raise
        self.capacity = self.heap.stats().capacity

    @property
    def buffer(self):
        """The Python buffer over the whole mapping (for building ndarray views)."""
        if self._mm is None:
            raise DeviceError(f"device {self.name!r} has no memory (size 0 or closed)")
        return self._mm

    @property
    def readonly_buffer(self):
        """A read-only uint8 ndarray over the whole mapping, for read-only views.

        An ndarray built on it cannot be made writable (NumPy checks its base), unlike one
        built on the mapping and marked read-only afterwards.
        """
        ro = self._ro
        if ro is None:
            import numpy as np

            ro = self._ro = np.frombuffer(memoryview(self.buffer).toreadonly(), np.uint8)
        return ro

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
        """Release the heap and drop the mapping; it is unmapped when the last view of it goes.

        The mapping is never closed here: NumPy arrays built on it keep a reference to it but
        no buffer export, so ``mmap.close()`` would succeed and unmap memory that a view, or a
        kernel running on one, still uses (a segfault). Dropping the reference leaves the unmap
        to the last holder. The native heap goes the same way: a Device method still running on
        another thread holds it (and it holds the mapping) until that call returns.
        """
        if self.closed:
            return
        self._refuse_if_owned()
        self.closed = True
        heap, self.heap = self.heap, None
        if heap is not None:
            heap._keepalive = self._mm            # Heap.__del__ destroys it after the last call
        del heap
        if self._base is not None:
            from ._native import ffi

            ffi.release(self._base)
            self._base = None
        self._mm = None
        self._ro = None
        self._cleanup_file()

    def _refuse_if_owned(self):
        """DeviceError while an open manager uses this device (its records point into it)."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None and not owner.closed:
            tiers = ", ".join(getattr(owner, "devices", None) or ())
            raise DeviceError(f"cannot close device {self.name!r} ({format_size(self.size)}): "
                              f"it belongs to an open manager (devices {tiers}) whose arrays "
                              "live on it; close the manager instead, which closes its devices")

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
        populate = copyengine.check_switch(populate, "DRAM: populate")
        hugepages = copyengine.check_switch(hugepages, "DRAM: hugepages")
        super().__init__(name, size, granularity)
        if self.size == 0:
            return
        if numa_node is not None:
            numa_node = _whole(numa_node, "numa_node", "a node number such as 0")
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


class VirtualDevice(Device):
    """A device whose heap is real but whose data is never touched: for replaying traces.

    The mapping is reserved (``MAP_NORESERVE``, no huge pages) and only the heap's 64-byte block
    headers are ever written, so a replay of a 4 GiB heap costs a few pages per live block. Copies
    to or from a virtual device are counted but move no bytes; arrays on one cannot be read:
    its regions have no buffer, so ``Manager.ndarray`` refuses every view of their data.
    """

    kind = "virtual"
    virtual = True
    _reserved = None                  # the mapping under the heap (``_mm`` stays None: no data)

    def __init__(self, size, name="fast", granularity=0, profile=None):
        super().__init__(name, size, granularity)
        self.profile = profile
        if self.size == 0:
            return
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        try:
            mm = mmap.mmap(-1, self.size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise DeviceError(f"cannot reserve {format_size(self.size)} of address space for "
                              f"virtual device {name!r}: {e.strerror}; ask for a smaller "
                              "virtual device") from None
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            try:
                mm.madvise(mmap.MADV_NOHUGEPAGE)   # a header write must not fault in 2 MiB
            except OSError:
                pass
        self._attach(mm)
        self.heap.set_nodata(True)                 # defrag slides headers, never data
        self._reserved, self._mm = self._mm, None  # regions made on it get no buffer

    @property
    def buffer(self):
        """None: a virtual device holds no data to view."""
        return None

    def close(self):
        if not self.closed:
            self._refuse_if_owned()
        if not self.closed and self._reserved is not None:
            self._mm = self._reserved              # the heap keeps it until its last call
        self._reserved = None
        super().close()


def _whole(value, what, example):
    """value as an int; TypeError naming what otherwise (a bool or a string is no number)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int ({example}), not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int ({example}), not {type(value).__name__} "
                        f"{value!r}") from None


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


def _lock_owner(st):
    """The pid holding a flock on the file st describes, read from /proc/locks, or None."""
    exact = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    same_inode = set()       # btrfs subvolumes and overlays report another device number
    try:
        with open("/proc/locks") as f:
            for line in f:
                # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2146817 0 EOF"; a waiter has "->" second
                fields = line.split()
                if len(fields) < 6 or fields[1] != "FLOCK" or int(fields[4]) <= 0:
                    continue
                if fields[5] == exact:
                    return int(fields[4])
                if fields[5].rpartition(":")[2] == str(st.st_ino):
                    same_inode.add(int(fields[4]))
    except (OSError, ValueError):
        return None
    return same_inode.pop() if len(same_inode) == 1 else None


def _held(path, st):
    """True when a live process holds the lock of the file st describes at path (asked of the
    kernel with a lock of our own, which /proc/locks cannot always answer: a holder in another
    PID namespace, or no /proc); False when none does; None when the file cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            return None                      # replaced since it was looked at
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        return False                         # closing the fd drops the trial lock
    finally:
        os.close(fd)


def _in_use(pid):
    """The reason a file locked by another manager is refused."""
    who = f"pid {pid}" if pid else "pid unknown"
    return (f"it is in use by another manager ({who}); two managers on one file overwrite each "
            "other's arrays: close that manager, or pass another path or a directory")


def _lock_file(fd, path, size):
    """Hold an exclusive lock on fd for the device's lifetime, so a second manager is refused."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DeviceError(f"cannot use slow_path {path!r} for the slow device ({size}): "
                          f"{_in_use(_lock_owner(os.fstat(fd)))}") from None
    except OSError as e:
        raise DeviceError(
            f"cannot lock slow_path {path!r} for the slow device ({size}): {e.strerror}; pass a "
            "directory instead (the slow device then maps a private file no other manager opens)"
        ) from None


def _refusal(path, st):
    """Why an existing path cannot back the slow device, and what to pass instead."""
    fix = ("pass a directory (a private file is made inside it), a new file name, or a devdax "
           "device such as /dev/dax0.0")
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        try:
            target = repr(os.readlink(path))
        except OSError:
            target = "another file"
        return (f"it is a symbolic link to {target}, which the slow device does not follow (it "
                f"would grow or overwrite the target); pass the target itself if it is a devdax "
                f"device, or {fix}")
    if stat.S_ISREG(mode):
        held = _held(path, st)
        pid = _lock_owner(st)
        if held or held is None and pid is not None:
            return _in_use(pid)
        nobody = "that no running manager holds" if held is False else "that no running " \
            "manager is known to hold"
        return (f"it is an existing file ({format_size(st.st_size)}) {nobody}, which the slow "
                f"device never reuses or overwrites; remove it if a crashed run left it behind, "
                f"or {fix}")
    if stat.S_ISCHR(mode):
        return (f"it is a character device but not a DAX device (the kernel does not list it "
                f"under {os.path.join(_SYSFS, 'bus', 'dax')}); {fix}")
    if stat.S_ISBLK(mode):
        return (f"it is a block device, which the slow device does not map; for persistent memory "
                f"mount a file system on it with -o dax, or {fix}")
    kind = "FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else "special file"
    return f"it is a {kind}, which the slow device cannot map; {fix}"


def _release_file(fd, path, ident, owner_pid):
    """Drop a slow device's lock; remove the file it created if the name still refers to it."""
    try:
        if path is not None and os.getpid() == owner_pid:     # not from a forked child
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == ident:
                os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot remove slow device file %r: %s", path, e.strerror)
    finally:
        os.close(fd)


class SlowDevice(Device):
    """The slow device: a devdax device, a file on a DAX file system, or a plain file.

    ``path=None`` (the embedded default) or a directory (a symbolic link to one is resolved) gets a
    fresh private file (mode 0600) that never has a name (``O_TMPFILE``), or whose name is removed
    as soon as it exists where the file system lacks that, so nothing is left behind by a crash.
    A new file name is created exclusively with mode 0600, locked against other managers for the
    device's lifetime and removed at close. A symbolic link to a file, an existing file, a
    character device the kernel does not list as DAX, and any other special file are refused; a
    devdax device is locked the same way, so two managers never share one.
    """

    kind = "slow"

    def __init__(self, size, path=None, name="slow", populate=False, granularity=0):
        populate = copyengine.check_switch(populate, "SlowDevice: populate")
        super().__init__(name, size, granularity)
        self._release = None       # drops the lock and removes a file this device created
        self._where = None         # what the not-DAX report names: the path, or the directory
        if self.size == 0:
            return
        fd, locked, chardev = self._open(path)
        try:
            self.dax = chardev or is_dax(self.path)
            self._reserve(fd)
            self._attach(self._map(fd, populate))
        except BaseException:
            if not locked:
                os.close(fd)
            self._cleanup_file()
            raise
        if not locked:
            os.close(fd)           # the nameless private file: the mapping keeps it alive
        if not self.dax:
            shown = self._where                  # a directory's private files: the directory
            if shown not in _reported_not_dax:
                _reported_not_dax.add(shown)
                level = logging.INFO if path is None else logging.WARNING
                log.log(level, "slow device %r on %s is not DAX: the OS page cache serves this "
                        "device", name, shown)

    def _open(self, path):
        """Open what the device maps and set self.path; return (fd, locked, chardev).

        A locked fd stays open for the device's lifetime; ``_cleanup_file`` closes it.
        """
        size = format_size(self.size)
        if path is not None:
            if not isinstance(path, (str, bytes, os.PathLike)):
                raise TypeError(f"slow_path must be a path (str or os.PathLike) or None, not "
                                f"{type(path).__name__}")
            path = os.fsdecode(os.fspath(path))
            if not path:
                raise DeviceError(f"slow_path is empty: pass None for a temporary file, a "
                                  f"directory or a new file name for the slow device ({size})")
            if "\0" in path:
                raise DeviceError(f"slow_path {path!r} contains a NUL character, which no file "
                                  f"name can hold; pass a directory or a new file name for the "
                                  f"slow device ({size})")
            if path.endswith(("/", os.sep)) and not os.path.isdir(path):
                # "dir/" names a directory: never create a file called "dir" in its place
                raise DeviceError(f"cannot use slow_path {path!r} for the slow device ({size}): "
                                  "it ends with '/', naming a directory, but there is no "
                                  "directory there; create it, or drop the '/' for a new file")
        if path is None or os.path.isdir(path):
            directory = os.path.realpath(tempfile.gettempdir() if path is None else path)
            self._where = "a temporary file" if path is None else f"a file in {directory}"
            return self._create_private(directory), False, False
        path = self._where = os.path.abspath(os.fspath(path))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return self._create_file(path), True, False
        except OSError as e:
            raise DeviceError(f"cannot use slow_path {path!r} for the slow device ({size}): "
                              f"{e.strerror}; pass a directory or a new file name") from None
        if stat.S_ISCHR(st.st_mode) and _is_devdax(st):
            return self._open_devdax(path, st), True, True
        raise DeviceError(f"cannot use slow_path {path!r} for the slow device ({size}): "
                          f"{_refusal(path, st)}")

    def _create_private(self, directory):
        """A fresh file in directory (mode 0600): one without a name (O_TMPFILE) where the file
        system has them, else one made with O_EXCL|O_NOFOLLOW whose name is removed at once."""
        size = format_size(self.size)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise DeviceError(
                f"cannot create the slow device ({size}) in {directory!r}: the directory is "
                "not writable; pass slow_path= a writable directory or file"
            )
        if hasattr(os, "O_TMPFILE"):
            try:
                fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise DeviceError(
                        f"cannot create a file for the slow device ({size}) in {directory!r}: "
                        f"{e.strerror}; pass slow_path= a writable directory"
                    ) from None
            else:
                self.path = os.path.join(directory, "cachedarrays-(unnamed).heap")
                return fd
        try:
            fd, self.path = tempfile.mkstemp(prefix="cachedarrays-", suffix=".heap", dir=directory)
        except OSError as e:
            raise DeviceError(
                f"cannot create a file for the slow device ({size}) in {directory!r}: "
                f"{e.strerror}; pass slow_path= a writable directory"
            ) from None
        try:
            # Before it grows: from here on only the fd keeps it, and a crash leaves nothing.
            os.unlink(self.path)
        except OSError as e:
            os.close(fd)
            raise DeviceError(f"cannot remove the name of the slow device's private file "
                              f"{self.path!r} ({size}): {e.strerror}; pass slow_path= a directory "
                              "you own") from None
        return fd

    def _create_file(self, path):
        """Create path exclusively with mode 0600 and lock it; close or a failure removes it."""
        size = format_size(self.size)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise DeviceError(f"cannot create slow device file {path!r} ({size}): the directory "
                              f"{parent!r} does not exist; create it or choose another path")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise DeviceError(f"cannot create slow device file {path!r} ({size}): another "
                              "process created it at the same moment; pass another path or a "
                              "directory") from None
        except OSError as e:
            raise DeviceError(f"cannot open slow device file {path!r} ({size}): {e.strerror}; "
                              "choose a writable path") from None
        st = os.fstat(fd)
        self.path = path
        self._release = weakref.finalize(self, _release_file, fd, path, (st.st_dev, st.st_ino),
                                         os.getpid())
        try:
            if stat.S_IMODE(st.st_mode) != 0o600:        # a umask or default ACL changed it
                os.fchmod(fd, 0o600)
                mode = stat.S_IMODE(os.fstat(fd).st_mode)
                if mode & 0o077:
                    raise DeviceError(
                        f"slow device file {path!r} ({size}) has mode {mode:04o}, not 0600: its "
                        "file system does not keep Unix permissions and other users could read "
                        "the arrays; choose a slow_path on a file system that does"
                    )
            _lock_file(fd, path, size)
        except BaseException:
            self._cleanup_file()
            raise
        return fd

    def _open_devdax(self, path, st):
        """Open and lock a devdax device; a second manager on it is refused."""
        size = format_size(self.size)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise DeviceError(f"cannot open devdax device {path!r} for the slow device "
                              f"({size}): {e.strerror}; check its permissions") from None
        self.path = path
        self._release = weakref.finalize(self, _release_file, fd, None, None, os.getpid())
        try:
            opened = os.fstat(fd)
            if not stat.S_ISCHR(opened.st_mode) or opened.st_rdev != st.st_rdev:
                raise DeviceError(f"devdax device {path!r} ({size}) changed while it was being "
                                  "opened; try again")
            _lock_file(fd, path, size)
        except BaseException:
            self._cleanup_file()
            raise
        return fd

    def _reserve(self, fd):
        """Make sure the backing store has room before mapping, so later writes cannot fault."""
        st = os.fstat(fd)
        if stat.S_ISCHR(st.st_mode):
            have = _devdax_size(st)
            if have is not None and have < self.size:
                raise DeviceError(
                    f"devdax device {self.path!r} holds {format_size(have)}, less than the slow "
                    f"device's {format_size(self.size)}; ask for at most {format_size(have)}"
                )
            return
        have = st.st_size
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
                raise self._no_room() from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise self._sizing_error(e) from None
            self._write_zeros(fd, have)

    def _write_zeros(self, fd, have):
        """Reserve [have, size) by writing zeros where the file system cannot fallocate: a
        file only grown by ftruncate has holes, and a page written into a hole on a full disk
        faults the process (SIGBUS) instead of raising."""
        zeros = memoryview(bytes(min(1 << 20, self.size)))
        off = have
        try:
            while off < self.size:
                wrote = os.pwrite(fd, zeros[:self.size - off], off)
                if wrote <= 0:                      # never reached on a working file system
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                off += wrote
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise self._no_room() from None
            raise self._sizing_error(e) from None

    def _no_room(self):
        """The DeviceError for a file system that ran out of room while the file grew."""
        return DeviceError(f"not enough room for the slow device at {self.path!r} "
                           f"({format_size(self.size)}); choose a smaller size or another path")

    def _sizing_error(self, e):
        """The DeviceError for a backing file that cannot grow to the device's size."""
        fix = "choose a smaller slow size or a slow_path on another file system"
        if e.errno == errno.EFBIG:
            fix = ("the process's file-size limit (ulimit -f) or the file system's largest file "
                   f"is smaller: raise the limit, or {fix}")
        return DeviceError(f"cannot size slow device file {self.path!r} to "
                           f"{format_size(self.size)}: {e.strerror}; {fix}")

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
        """Drop the lock and remove the file this device created (close calls this)."""
        release, self._release = self._release, None
        if release is not None:
            release()
