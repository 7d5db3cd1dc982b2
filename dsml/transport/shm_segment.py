"""Named shared-memory segments in /dev/shm, and removing those of dead owners (transport).

A segment's name says who made it: `dsml.<boot>.<pid>.<member>.<epoch>.<kind>`, where
`boot` is the first 8 hex digits of the kernel's boot id and `pid` the creating process.
That is how anyone can tell an orphan: a segment of this boot whose creator is gone (or a
zombie), or one left from another boot. `sweep_orphans` removes those; every new link
calls it, so after a `kill -9` the survivors' next epoch and the next start clean up.

Segments are also unlinked as early as possible (once every peer has mapped them, see
`shm_link.py`): the memory then lives only as long as some process maps it, and a process
killed afterwards leaves no file behind at all.

Space is reserved with `posix_fallocate` when a segment is made, so a full /dev/shm shows
up as a clean `ShmFullError` here instead of a SIGBUS on first write.

A mapping needs no file descriptor (the kernel keeps the pages mapped), but Python's
`mmap.mmap` keeps a duplicate of the one it was given, for `size()` and `resize()`, which
dsml never calls: one descriptor per mapped segment, two or more per same-host peer, and
what ran a group of 160 ranks out of the default limit of 1,024. `_map` drops it:
`trackfd=False` on Python 3.13 and later; before, the duplicate is closed and forgotten by
the object (its `fd` field set to -1, as `trackfd=False` leaves it), but only where the
field is found to hold a descriptor of the very file just mapped, else it is kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PREFIX",
    "SHM_DIR",
    "Segment",
    "ShmFullError",
    "host_identity",
    "segment_name",
    "shm_free_bytes",
    "sweep_orphans",
]

SHM_DIR = Path("/dev/shm")
PREFIX = "dsml."


class ShmFullError(OSError):
    """There is no room left in /dev/shm for a segment of the requested size."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
    except OSError:
        return "0" * 32


BOOT_ID = _boot_id()
BOOT = BOOT_ID[:8]


def host_identity() -> str:
    """What members that share memory have in common: boot id and /dev/shm's device.

    Two members with the same host name and this string run under one kernel and see the
    same /dev/shm (containers on one machine with separate /dev/shm mounts differ in the
    device); empty when there is no usable /dev/shm.
    """
    try:
        st = os.stat(SHM_DIR)
    except OSError:
        return ""
    if not os.access(SHM_DIR, os.W_OK):
        return ""
    return f"{BOOT_ID}:{st.st_dev:x}"


def hostname() -> str:
    return socket.gethostname()


def segment_name(pid: int, member: str, epoch: int, kind: str) -> str:
    """The name of a segment made by process `pid` for `member` in `epoch`."""
    return f"{PREFIX}{BOOT}.{pid}.{member}.{epoch}.{kind}"


def shm_free_bytes() -> int:
    """Bytes still free in /dev/shm (0 when it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


#: where CPython's mmap object keeps its duplicate descriptor (found once; None: unknown)
_fd_offset: int | None = None


def _map(fd: int, size: int) -> mmap.mmap:
    """Map `size` bytes of file `fd`, keeping no descriptor open (see the module docstring)."""
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, trackfd=False)  # type: ignore[call-arg,unused-ignore]
    mapped = mmap.mmap(fd, size)
    if sys.implementation.name == "cpython":  # elsewhere id() is no address
        _forget_fd(mapped, fd)
    return mapped


def _forget_fd(mapped: mmap.mmap, fd: int) -> None:
    """Close the duplicate of `fd` that `mapped` holds (Python before 3.13)."""
    global _fd_offset
    st = os.fstat(fd)
    offsets = [_fd_offset] if _fd_offset is not None else range(16, sys.getsizeof(mapped) - 3, 4)
    for offset in offsets:
        field = ctypes.c_int.from_address(id(mapped) + offset)
        if field.value != fd and _same_file(field.value, st):
            os.close(field.value)
            field.value = -1
            _fd_offset = offset
            return


def _same_file(fd: int, st: os.stat_result) -> bool:
    if fd <= 2:
        return False
    try:
        other = os.fstat(fd)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


@dataclass(eq=False)
class Segment:
    """One mapped segment; `unlink` removes its name, `close` unmaps it."""

    name: str
    size: int
    map: mmap.mmap
    owned: bool
    linked: bool = True

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Make a new segment of `size` bytes, its space reserved; ShmFullError if no room."""
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(path)
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise ShmFullError(
                        exc.errno, f"no room in {SHM_DIR} for {size} bytes"
                    ) from None
                raise
            return cls(name, size, _map(fd, size), owned=True)
        finally:
            os.close(fd)

    @classmethod
    def open(cls, name: str) -> Segment | None:
        """Map a peer's segment; None when it does not exist (yet, or any more)."""
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return None  # being created: its size is not set yet
            return cls(name, size, _map(fd, size), owned=False, linked=False)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name (mappings stay valid until closed)."""
        if self.owned and self.linked:
            self.linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR / self.name)

    def close(self) -> bool:
        """Remove the name if it is ours, and unmap; False while a view into it is alive
        (then it is unmapped with the last view)."""
        self.unlink()
        try:
            self.map.close()
        except BufferError:
            return False
        return True

    def __repr__(self) -> str:
        state = "linked" if self.linked else "unlinked"
        return f"<Segment {self.name} {self.size} bytes {state}>"


def _owner_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True  # cannot tell: keep its segments
    state = stat.rsplit(")", 1)[-1].split()[0:1]
    return state != ["Z"] and state != ["X"]


def sweep_orphans() -> list[str]:
    """Remove dsml segments whose creator is dead (or from another boot); returns names."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        parts = name[len(PREFIX) :].split(".")
        if len(parts) < 2 or not parts[1].isdigit():
            continue
        if parts[0] == BOOT and _owner_alive(int(parts[1])):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(SHM_DIR / name)
            removed.append(name)
    return removed
