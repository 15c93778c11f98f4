"""slow_path safety: no symlink following, no reuse of existing files, private modes, one manager
per file or devdax device, only real DAX character devices, nothing left behind by a crash."""

import errno
import gc
import mmap
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays import devices
from cachedarrays.errors import DeviceError


def leftovers(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("cachedarrays-"))


def run_python(code, *args, **kwargs):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                            text=True, **kwargs)


@pytest.fixture
def user_file(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_bytes(b"precious user data\n")
    p.chmod(0o644)
    return p


def assert_untouched(p):
    assert p.read_bytes() == b"precious user data\n"
    assert p.stat().st_size == 19 and stat.S_IMODE(p.stat().st_mode) == 0o644


# ---- symbolic links ------------------------------------------------------------------------

def test_symlink_to_a_user_file_is_refused_and_the_file_is_untouched(tmp_path, user_file):
    link = tmp_path / "slow.heap"
    link.symlink_to(user_file)
    with pytest.raises(DeviceError, match="symbolic link") as e:
        devices.SlowDevice("1MiB", path=str(link))
    assert str(link) in str(e.value) and str(user_file) in str(e.value)
    assert "1.0 MiB" in str(e.value) and "new file name" in str(e.value)
    assert_untouched(user_file)
    assert link.is_symlink()


def test_dangling_symlink_is_refused_and_its_target_is_not_created(tmp_path):
    link = tmp_path / "slow.heap"
    link.symlink_to(tmp_path / "elsewhere.heap")
    with pytest.raises(DeviceError, match="symbolic link"):
        devices.SlowDevice("1MiB", path=str(link))
    assert not (tmp_path / "elsewhere.heap").exists()


def test_manager_refuses_a_symlinked_slow_path(tmp_path, user_file):
    link = tmp_path / "slow.heap"
    link.symlink_to(user_file)
    with pytest.raises(DeviceError, match="symbolic link"):
        ca.Manager(fast="1MiB", slow="1MiB", slow_path=str(link))
    assert_untouched(user_file)


def test_symlink_to_a_directory_gets_a_private_file_in_the_real_directory(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    dev = devices.SlowDevice("1MiB", path=str(link))
    assert os.path.dirname(dev.path) == os.path.realpath(real)
    assert leftovers(real) == [] and link.is_symlink()
    dev.close()
    assert sorted(os.listdir(tmp_path)) == ["link", "real"] and os.listdir(real) == []


# ---- existing files and modes --------------------------------------------------------------

def test_existing_regular_file_is_refused_with_its_contents_intact(user_file):
    with pytest.raises(DeviceError, match="existing file") as e:
        devices.SlowDevice("1MiB", path=str(user_file))
    assert str(user_file) in str(e.value) and "remove it" in str(e.value)
    assert_untouched(user_file)


def test_existing_empty_file_is_refused_too(tmp_path):
    p = tmp_path / "slow.heap"
    p.touch()
    with pytest.raises(DeviceError, match="existing file"):
        devices.SlowDevice("1MiB", path=str(p))
    assert p.stat().st_size == 0


def test_new_file_gets_mode_0600_even_with_umask_zero(tmp_path):
    p = tmp_path / "slow.heap"
    old = os.umask(0)
    try:
        dev = devices.SlowDevice("1MiB", path=str(p))
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.stat().st_uid == os.geteuid()
    dev.close()


def test_mode_is_forced_to_0600_when_creation_widens_it(tmp_path, monkeypatch):
    """A default ACL or a permissive file system may widen the mode asked for at creation."""
    p = tmp_path / "slow.heap"
    real_open = os.open

    def widening_open(path, flags, mode=0o777, **kw):
        fd = real_open(path, flags, mode, **kw)
        if flags & os.O_CREAT:
            os.fchmod(fd, 0o666)
        return fd

    monkeypatch.setattr(devices.os, "open", widening_open)
    dev = devices.SlowDevice("1MiB", path=str(p))
    monkeypatch.undo()
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    dev.close()


def test_new_file_is_removed_at_close_and_the_path_can_be_used_again(tmp_path):
    p = tmp_path / "slow.heap"
    for _ in range(2):
        with ca.Manager(fast="1MiB", slow="1MiB", slow_path=str(p)) as m:
            x = ca.zeros(1000, manager=m)
            ca.evict(x)
            assert p.exists()
            del x
        assert not p.exists()


def test_a_file_replaced_under_the_device_is_not_removed_at_close(tmp_path):
    p = tmp_path / "slow.heap"
    dev = devices.SlowDevice("1MiB", path=str(p))
    p.unlink()
    p.write_bytes(b"someone else's file")
    dev.close()
    assert p.read_bytes() == b"someone else's file"


def test_device_dropped_without_close_releases_its_file(tmp_path):
    p = tmp_path / "slow.heap"
    dev = devices.SlowDevice("1MiB", path=str(p))
    del dev
    gc.collect()
    assert not p.exists()
    devices.SlowDevice("1MiB", path=str(p)).close()


def test_file_left_by_a_killed_manager_is_refused_with_the_fix(tmp_path):
    p = tmp_path / "slow.heap"
    child = run_python("""
        import os, signal, sys
        from cachedarrays import devices
        dev = devices.SlowDevice("1MiB", path=sys.argv[1])
        os.kill(os.getpid(), signal.SIGKILL)
    """, p)
    assert child.wait(timeout=60) == -signal.SIGKILL
    assert p.exists()                                # a named file cannot vanish on kill -9
    with pytest.raises(DeviceError, match="existing file.*remove it if a crashed run"):
        devices.SlowDevice("1MiB", path=str(p))


# ---- one manager per file ------------------------------------------------------------------

def test_two_managers_on_one_path_in_one_process(tmp_path):
    p = tmp_path / "slow.heap"
    with ca.Manager(fast="1MiB", slow="1MiB", slow_path=str(p)) as m:
        x = ca.full(1000, 5.0, manager=m)
        ca.evict(x)
        with pytest.raises(DeviceError, match=rf"in use by another manager \(pid {os.getpid()}\)"):
            ca.Manager(fast="1MiB", slow="1MiB", slow_path=str(p))
        assert p.exists()
        with ca.readable(x) as a:
            assert (a == 5.0).all()
        del x, a
    ca.Manager(fast="1MiB", slow="1MiB", slow_path=str(p)).close()


def test_two_managers_on_one_path_in_two_processes(tmp_path):
    p = tmp_path / "slow.heap"
    child = run_python("""
        import sys
        import cachedarrays as ca
        m = ca.Manager(fast="1MiB", slow="1MiB", slow_path=sys.argv[1])
        print("ready", flush=True)
        sys.stdin.readline()
        m.close()
    """, p, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(DeviceError, match=rf"in use by another manager \(pid {child.pid}\)"):
            devices.SlowDevice("1MiB", path=str(p))
    finally:
        child.stdin.write("\n")
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    assert not p.exists()
    devices.SlowDevice("1MiB", path=str(p)).close()



@pytest.mark.parametrize("holder", ["this process", "another process"])
def test_a_file_a_live_manager_holds_is_refused_as_in_use_when_proc_locks_cannot_say(
        tmp_path, monkeypatch, holder):
    # /proc/locks names no holder in another PID namespace (or without /proc): the refusal asks
    # the file's lock itself, and never tells the user to remove a file in use
    p = tmp_path / "slow.heap"
    monkeypatch.setattr(devices, "_lock_owner", lambda st: None)
    if holder == "this process":
        child, dev = None, devices.SlowDevice("1MiB", path=str(p))
    else:
        child = run_python("""
            import sys
            from cachedarrays import devices
            dev = devices.SlowDevice("1MiB", path=sys.argv[1])
            print("ready", flush=True)
            sys.stdin.readline()
            dev.close()
        """, p, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert child.stdout.readline().strip() == "ready"
    try:
        with pytest.raises(DeviceError, match=r"in use by another manager \(pid unknown\)") as e:
            devices.SlowDevice("1MiB", path=str(p))
        assert "remove it" not in str(e.value)
    finally:
        if child is None:
            dev.close()
        else:
            child.stdin.write("\n")
            child.stdin.close()
            assert child.wait(timeout=60) == 0
    assert not p.exists()


def test_a_left_file_is_named_as_held_by_no_running_manager(tmp_path, monkeypatch):
    p = tmp_path / "slow.heap"
    p.write_bytes(bytes(4096))
    p.chmod(0o600)
    for owner in (None, 4242):          # what /proc/locks says cannot overrule the lock itself
        monkeypatch.setattr(devices, "_lock_owner", lambda st: owner)
        with pytest.raises(DeviceError, match="existing file .* that no running manager holds.*"
                                              "remove it if a crashed run") as e:
            devices.SlowDevice("1MiB", path=str(p))
        assert str(p) in str(e.value)
    assert p.read_bytes() == bytes(4096)

# ---- character devices and other special files ---------------------------------------------

@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null"])
def test_ordinary_character_devices_are_not_devdax(path):
    if not os.path.exists(path):
        pytest.skip(f"{path} is missing here")
    assert not devices.is_dax(path)
    with pytest.raises(DeviceError, match="character device but not a DAX device") as e:
        devices.SlowDevice("1MiB", path=path)
    assert path in str(e.value) and "/dev/dax0.0" in str(e.value)


@pytest.fixture
def zero_as_devdax(tmp_path, monkeypatch):
    """A sysfs in which the kernel lists /dev/zero as a DAX device of 4 MiB."""
    rdev = os.stat("/dev/zero").st_rdev
    sysfs = tmp_path / "sys"
    (sysfs / "bus" / "dax" / "devices").mkdir(parents=True)
    node = sysfs / "devices" / "dax0.0"
    node.mkdir(parents=True)
    (node / "subsystem").symlink_to(sysfs / "bus" / "dax", target_is_directory=True)
    (node / "size").write_text(f"{4 << 20}\n")
    (sysfs / "dev" / "char").mkdir(parents=True)
    (sysfs / "dev" / "char" / f"{os.major(rdev)}:{os.minor(rdev)}").symlink_to(node)
    monkeypatch.setattr(devices, "_SYSFS", str(sysfs))
    return "/dev/zero"


def test_devdax_is_recognised_from_sysfs_mapped_and_locked(zero_as_devdax):
    assert devices.is_dax(zero_as_devdax)
    dev = devices.SlowDevice("1MiB", path=zero_as_devdax)
    assert dev.dax and dev.path == zero_as_devdax
    with pytest.raises(DeviceError, match=rf"in use by another manager \(pid {os.getpid()}\)"):
        devices.SlowDevice("1MiB", path=zero_as_devdax)
    off = dev.alloc(100, 1)
    a = np.ndarray((100,), np.uint8, dev.buffer, off + 64)
    a[:] = 9
    assert int(a.sum()) == 900
    del a
    dev.close()
    devices.SlowDevice("1MiB", path=zero_as_devdax).close()
    assert os.path.exists("/dev/zero")


def test_devdax_smaller_than_the_slow_size_is_refused(zero_as_devdax):
    with pytest.raises(DeviceError, match="holds 4.0 MiB, less than .* 8.0 MiB"):
        devices.SlowDevice("8MiB", path=zero_as_devdax)
    devices.SlowDevice("1MiB", path=zero_as_devdax).close()        # the lock was released


def test_symlink_to_a_devdax_device_is_refused(tmp_path, zero_as_devdax):
    link = tmp_path / "dax"
    link.symlink_to(zero_as_devdax)
    with pytest.raises(DeviceError, match="symbolic link.*pass the target itself"):
        devices.SlowDevice("1MiB", path=str(link))


def test_fifo_is_refused(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(DeviceError, match="it is a FIFO") as e:
        devices.SlowDevice("1MiB", path=str(fifo))
    assert str(fifo) in str(e.value)


def test_socket_is_refused(tmp_path):
    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(DeviceError, match="it is a socket"):
            devices.SlowDevice("1MiB", path=str(path))


def test_block_device_is_refused_with_the_dax_mount_hint():
    blocks = [e.path for e in os.scandir("/dev")
              if stat.S_ISBLK(e.stat(follow_symlinks=False).st_mode)]
    if not blocks:
        pytest.skip("no block device in /dev")
    with pytest.raises(DeviceError, match="block device.*-o dax"):
        devices.SlowDevice("1MiB", path=blocks[0])


# ---- the private temporary file ------------------------------------------------------------

def test_temporary_file_has_no_name_while_it_is_reserved_and_mapped(tmp_path, monkeypatch):
    seen = []
    real_fallocate, real_mmap = os.posix_fallocate, mmap.mmap

    def fallocate(fd, offset, length):
        seen.append(("fallocate", leftovers(tmp_path)))
        return real_fallocate(fd, offset, length)

    def mapping(fd, length, **kw):
        seen.append(("mmap", leftovers(tmp_path)))
        return real_mmap(fd, length, **kw)

    monkeypatch.setattr(devices.os, "posix_fallocate", fallocate)
    monkeypatch.setattr(devices.mmap, "mmap", mapping)
    dev = devices.SlowDevice("1MiB", path=str(tmp_path))
    monkeypatch.undo()
    assert seen == [("fallocate", []), ("mmap", [])]
    assert leftovers(tmp_path) == []
    dev.close()


@pytest.mark.parametrize("where", ["posix_fallocate", "mmap"])
@pytest.mark.parametrize("named", [False, True], ids=["directory", "new-file"])
def test_failed_construction_leaves_nothing_behind(tmp_path, monkeypatch, where, named):
    def fail(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(devices.os if where == "posix_fallocate" else devices.mmap, where, fail)
    path = tmp_path / "slow.heap" if named else tmp_path
    with pytest.raises(DeviceError, match="Input/output error"):
        devices.SlowDevice("1MiB", path=str(path))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    if named:
        devices.SlowDevice("1MiB", path=str(path)).close()     # no lock or file left behind


def test_killed_construction_leaves_no_temporary_file(tmp_path):
    child = run_python("""
        import os, signal, sys
        from cachedarrays import devices
        os.posix_fallocate = lambda fd, offset, length: os.kill(os.getpid(), signal.SIGKILL)
        devices.SlowDevice("16GiB", path=sys.argv[1])
    """, tmp_path)
    assert child.wait(timeout=60) == -signal.SIGKILL
    assert leftovers(tmp_path) == []


def test_full_file_system_is_refused_for_a_new_file_and_the_file_removed(tmp_path,
                                                                        full_file_system):
    p = tmp_path / "slow.heap"
    with pytest.raises(DeviceError, match="not enough room") as e:
        devices.SlowDevice("64MiB", path=str(p))
    assert str(p) in str(e.value) and "64.0 MiB" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_new_file_in_an_unwritable_directory_is_reported(tmp_path, monkeypatch):
    real_open = os.open

    def deny_create(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(devices.os, "open", deny_create)
    p = tmp_path / "slow.heap"
    with pytest.raises(DeviceError, match="Permission denied.*writable path") as e:
        devices.SlowDevice("1MiB", path=str(p))
    assert str(p) in str(e.value)


# ---- path text that names no file ----------------------------------------------------------

@pytest.mark.parametrize("as_bytes", [False, True])
@pytest.mark.parametrize("where", ["missing/", "missing//", "missing/sub/", "sub/./"])
def test_a_path_ending_in_a_slash_names_a_directory_that_must_exist(tmp_path, where, as_bytes):
    # "missing/" must not become a file called "missing"
    path = str(tmp_path) + "/" + where
    with pytest.raises(DeviceError, match="ends with '/'") as e:
        devices.SlowDevice("1MiB", path=os.fsencode(path) if as_bytes else path)
    assert "1.0 MiB" in str(e.value) and "create it" in str(e.value)
    assert os.listdir(tmp_path) == []
    (tmp_path / where.strip("/.")).mkdir(parents=True)       # once it exists, it is used
    dev = devices.SlowDevice("1MiB", path=os.fsencode(path) if as_bytes else path)
    try:
        assert os.path.dirname(dev.path) == str(tmp_path / where.strip("/."))
    finally:
        dev.close()


@given(prefix=st.text(alphabet="abc.-_", max_size=6), suffix=st.text(alphabet="abc/", max_size=6),
       as_bytes=st.booleans())
@settings(max_examples=40, deadline=None)
def test_a_nul_in_the_path_is_refused_naming_slow_path(tmp_path_factory, prefix, suffix, as_bytes):
    d = tmp_path_factory.mktemp("nul")
    path = str(d / prefix) + "\0" + suffix
    with pytest.raises(DeviceError, match="NUL character") as e:
        devices.SlowDevice("1MiB", path=os.fsencode(path) if as_bytes else path)
    assert "slow_path" in str(e.value) and "1.0 MiB" in str(e.value)
    assert os.listdir(d) == []


# ---- room reserved up front without fallocate ----------------------------------------------

def _no_fallocate(monkeypatch, code):
    def fallocate(fd, offset, length):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(devices.os, "posix_fallocate", fallocate)


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS])
@pytest.mark.parametrize("size", [4097, 1 << 16, (3 << 20) + 256])
def test_without_fallocate_every_block_of_the_file_is_written(tmp_path, monkeypatch, code, size):
    # a file only grown by ftruncate has holes: a page written into one on a full disk is a SIGBUS
    _no_fallocate(monkeypatch, code)
    p = tmp_path / "slow.heap"
    dev = devices.SlowDevice(size, path=str(p))
    try:
        st = os.stat(p)
        assert st.st_size == size and st.st_blocks * 512 >= size
    finally:
        dev.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("named", [False, True])
def test_without_fallocate_a_full_disk_is_refused_and_nothing_left(tmp_path, monkeypatch, named):
    _no_fallocate(monkeypatch, errno.EOPNOTSUPP)
    real_pwrite, written = os.pwrite, []

    def pwrite(fd, data, offset):              # the disk fills up after the first 4 KiB
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(offset)
        return real_pwrite(fd, data[:4096], offset)

    monkeypatch.setattr(devices.os, "pwrite", pwrite)
    path = tmp_path / "slow.heap" if named else tmp_path
    with pytest.raises(DeviceError, match="not enough room") as e:
        devices.SlowDevice("8MiB", path=str(path))
    assert "8.0 MiB" in str(e.value) and str(tmp_path) in str(e.value)
    assert os.listdir(tmp_path) == []
