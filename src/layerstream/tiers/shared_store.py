"""One host store per node: the local ranks of a data-parallel run share its arenas.

The frozen layer weights are the same on every rank and never change, so one copy in
shared memory serves all the ranks of a node. A segment is a set of files in
``/dev/shm`` (``LAYERSTREAM_SHM_DIR`` elsewhere) named from a fingerprint of what
decides its bytes (checkpoint files, dtype, quantisation, layerstream's layout):

    layerstream-<fp>.lock       every rank using the segment holds flock(LOCK_SH) on it
    layerstream-<fp>.build      claimed by the one rank that builds: holds its pid, and that
                                rank holds flock(LOCK_EX) on it until the manifest is in place
    layerstream-<fp>.<i>.arena  arena i, written layer by layer by the builder
    layerstream-<fp>.manifest   the layout, renamed into place when the build is complete

The other ranks wait for the manifest, map the same pages read-only and check that the
layout they compute is the manifest's. The manifest also holds each layer's checksum of
the bytes the builder wrote; a rank that joins with ``checksum=True`` checks every layer's
mapped bytes against it and refuses a segment that was modified since. With
``checksum=False`` a joining rank trusts the segment: any process of the same user can
write its files, and the name fingerprints the checkpoint and settings, not the bytes.
Lifetime rests on the kernel's flock bookkeeping,
which a crash or SIGKILL cannot skip: a segment whose lock file can be locked LOCK_EX has
no user left and is removed, by each rank as it leaves and by every new run before it
starts (``sweep``). A rank waiting for the manifest raises as soon as the build claim's
lock is free without one: the builder was killed (SIGKILL included) or gave up part way,
and the bytes it wrote are never mapped. The claim appears already locked and holding the
builder's pid (a hard link of a file locked first), so there is no moment at which a live
build looks abandoned, and no pid is trusted across pid namespaces or reuse.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from ..errors import LoadingError, StreamingError
from ..system.log import get_logger
from ..units import GiB, size_text
from .checksum import checksum_of

PREFIX = "layerstream-"
LAYOUT_VERSION = 1  # bump whenever the arena layout (alignment, packing) changes
WAIT_SECONDS = 600.0  # how long a rank waits for another to build the segment
_POLL_SECONDS = 0.05

logger = get_logger(__name__)


class SharedStoreError(StreamingError):
    """The shared host store cannot be built or used."""


def directory() -> Path:
    """Where segments live: LAYERSTREAM_SHM_DIR, else /dev/shm."""
    return Path(os.environ.get("LAYERSTREAM_SHM_DIR") or "/dev/shm")


def free_bytes(folder: Path) -> int:
    """The bytes new files in ``folder`` can still take."""
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def wanted(setting, local_world_size: Optional[int] = None) -> bool:
    """Whether to share: ``share_host_store`` True, or "auto" with more than one local rank
    (LOCAL_WORLD_SIZE, set by torchrun and accelerate launch)."""
    if setting != "auto":
        return bool(setting)
    if local_world_size is None:
        try:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        except ValueError:
            local_world_size = 1
    return local_world_size > 1


def fingerprint(files: List[Path], **settings) -> str:
    """A name for the bytes of a store: each checkpoint file's path, size, mtime, inode and
    ctime, the settings that change what is packed, the layout version and the user.

    The inode and ctime tell apart files the size and mtime do not: another checkpoint of
    the same shapes copied over the name with its times kept (``cp -p``, ``rsync -a``), or
    bytes written in place with the mtime set back. A segment of the old bytes must not be
    joined then, and ``checksum=True`` cannot tell, since a joiner checks the segment
    against what its builder read. A false difference only builds a new segment."""
    digest = hashlib.sha256()
    for path in sorted({Path(p).resolve() for p in files}):
        stat = path.stat()
        identity = f"{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}\0{stat.st_ctime_ns}"
        digest.update(f"{path}\0{identity}\n".encode())
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(f"layout={LAYOUT_VERSION} uid={os.getuid()}".encode())
    return digest.hexdigest()[:32]


def _write_claim(fd: int, data: bytes) -> None:
    """Write the builder's pid into its (not yet visible) build claim."""
    os.write(fd, data)


# the names a segment's files take, and nothing else: the sweep must never remove a file of
# the user's that merely starts with the prefix (layerstream-notes.txt, layerstream-0.3.tar.gz)
_SEGMENT_FILE = re.compile(
    rf"^(?P<name>{re.escape(PREFIX)}[0-9a-f]{{32}})\."
    r"(?:lock|build|manifest|\d+\.arena|build\.[A-Za-z0-9_]+\.tmp|manifest\.\d+\.tmp)$"
)


def segment_of(filename: str) -> Optional[str]:
    """The segment a file of the shared store belongs to, or None for any other file."""
    found = _SEGMENT_FILE.match(filename)
    return found.group("name") if found else None


def _files_of(folder: Path, name: str) -> List[Path]:
    return [p for p in folder.glob(f"{name}.*") if segment_of(p.name) == name and not p.name.endswith(".lock")]


def _try_lock(fd: int, kind: int) -> bool:
    """Take ``kind`` (LOCK_EX or LOCK_SH) on ``fd`` without waiting; False where another
    process holds a lock that conflicts."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _remove_if_unused(lock: Path) -> bool:
    """Remove the segment of ``lock`` when no process holds its lock; True if removed."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        if not _try_lock(fd, fcntl.LOCK_EX):
            return False
        try:
            if os.stat(lock).st_ino != os.fstat(fd).st_ino:
                return False  # removed and made again by someone else meanwhile
        except FileNotFoundError:
            return False
        for path in _files_of(lock.parent, lock.name[: -len(".lock")]):
            path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)  # last: a new user of the name re-checks the inode
        return True
    finally:
        os.close(fd)


def sweep(folder: Optional[Path] = None) -> List[str]:
    """Remove every segment in ``folder`` that no process uses (left by a crash or a
    SIGKILL); returns their names. Segments in use are left alone."""
    folder = folder or directory()
    removed = []
    for lock in sorted(folder.glob(f"{PREFIX}*.lock")):
        if segment_of(lock.name) is not None and _remove_if_unused(lock):
            removed.append(lock.name[: -len(".lock")])
    for path in folder.glob(f"{PREFIX}*.*"):  # files whose lock is gone (a sweep that died)
        name = segment_of(path.name)
        if name is not None and not path.name.endswith(".lock") and not (folder / f"{name}.lock").exists():
            path.unlink(missing_ok=True)
    return removed


class Segment:
    """This process's use of one shared segment: built here (``builder``) or mapped."""

    def __init__(
        self, name: str, folder: Optional[Path] = None, wait_seconds: float = WAIT_SECONDS, verify: bool = False
    ):
        self.folder = folder or directory()
        self.name = name
        self.wait_seconds = wait_seconds
        self.verify = verify  # a joining rank checks each layer's bytes against the builder's checksums
        self.builder = False
        self.needed: Optional[int] = None  # the store's planned bytes, when known
        self.manifest: Optional[dict] = None
        self._lock_fd: Optional[int] = None
        self._claim_fd: Optional[int] = None  # the builder's flock(LOCK_EX) on the build claim
        self._maps: Dict[int, mmap.mmap] = {}  # arena -> read-only mapping
        self._writers: Dict[int, mmap.mmap] = {}  # arena -> writable mapping (builder)
        self.arena_sizes: List[int] = []

    def path(self, suffix: str) -> Path:
        return self.folder / f"{self.name}.{suffix}"

    def arena_path(self, index: int) -> Path:
        return self.path(f"{index}.arena")

    # -- joining ------------------------------------------------------------------------------
    def join(self, needed: Optional[int] = None) -> "Segment":
        """Hold the segment's lock, then build it (first to claim) or wait until it is built.
        The builder refuses a store of ``needed`` bytes that the folder has no room for."""
        try:
            claimed = self._hold_and_claim()
        except OSError as exc:  # a folder that cannot be written (read-only, not ours, full)
            with contextlib.suppress(OSError):
                self.leave()
            raise SharedStoreError(
                f"cannot create the shared host store {self.name} in {self.folder} ({exc}). Nothing was loaded. "
                "Point LAYERSTREAM_SHM_DIR at a writable directory on a tmpfs (such as /dev/shm), or pass "
                "share_host_store=False so each rank keeps its own store."
            ) from exc
        if not claimed:
            self._wait()
            return self
        self.builder, self.needed = True, needed
        free = free_bytes(self.folder)
        if needed is not None and needed > free:
            self.leave()
            raise self._no_room(needed, free)
        return self

    def _hold_and_claim(self) -> bool:
        """Hold the segment's lock, then claim its build; False when another rank has it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        sweep(self.folder)
        lock = self.path("lock")
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                same = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # a sweep removed it between our open and our lock: again
        self._lock_fd = fd
        _JOINED.append(self)
        # the claim is made locked and written under a name of its own, then linked into place:
        # the first link wins, and whoever sees the claim sees it locked and holding the pid
        claim, staged_name = tempfile.mkstemp(prefix=f"{self.name}.build.", suffix=".tmp", dir=self.folder)
        staged = Path(staged_name)
        try:
            fcntl.flock(claim, fcntl.LOCK_EX)
            _write_claim(claim, str(os.getpid()).encode())
            os.link(staged, self.path("build"))
        except FileExistsError:
            os.close(claim)
            return False
        except BaseException:
            os.close(claim)
            raise
        finally:
            staged.unlink(missing_ok=True)
        self._claim_fd = claim  # held until the manifest is in place, or this rank leaves
        return True

    def _no_room(self, needed: int, free: int, why: str = "") -> SharedStoreError:
        """Writing a page a full tmpfs cannot back kills the writer with SIGBUS: refused instead."""
        return SharedStoreError(
            f"the shared host store {self.name} needs {size_text(needed)} in {self.folder}, which has "
            f"{size_text(free)} free{why}, so it is refused before a page is written (one the folder cannot "
            "back would kill this process with SIGBUS). Give it room: start the container with "
            f"--shm-size={-(-needed // GiB) + 1}g or more (Docker's /dev/shm is 64 MiB by default), point "
            "LAYERSTREAM_SHM_DIR at a larger tmpfs, or pass share_host_store=False so each rank keeps its own "
            "store in its own memory."
        )

    def _wait(self) -> None:
        deadline = time.monotonic() + self.wait_seconds
        manifest = self.path("manifest")
        while not manifest.exists():
            pid = self._builder_pid()
            if not self._build_claimed() and not manifest.exists():
                raise SharedStoreError(
                    f"the rank building the shared host store {self.name} (pid {pid}) stopped before it "
                    "finished (it was killed, or it failed: see that rank's error), so the part it wrote is "
                    "not used and nothing was loaded here. Run again: the segment is removed when this "
                    "run's ranks exit."
                )
            if time.monotonic() > deadline:
                raise SharedStoreError(
                    f"waited {self.wait_seconds:.0f} s for pid {pid} to build the shared host store "
                    f"{self.name} in {self.folder}; it is still running but not done. Check that rank, or "
                    "pass share_host_store=False to give each rank its own store."
                )
            time.sleep(_POLL_SECONDS)
        self.manifest = json.loads(manifest.read_text())
        self.arena_sizes = list(self.manifest["arenas"])

    def _builder_pid(self) -> Optional[int]:
        try:
            text = self.path("build").read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() else None

    def _build_claimed(self) -> bool:
        """Whether a live rank still holds the build claim's lock (a killed one's is released
        by the kernel; a claim that is gone is held by nobody)."""
        try:
            fd = os.open(self.path("build"), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            return not _try_lock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)

    # -- arenas -------------------------------------------------------------------------------
    def new_arena(self, index: int, size: int) -> mmap.mmap:
        """Arena ``index`` of ``size`` bytes, mapped read-only; the builder creates its file.
        A follower's arena must have the size the builder gave it."""
        path = self.arena_path(index)
        if self.builder:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                self._reserve(fd, index, size)
                self._writers[index] = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.arena_sizes.append(size)
        elif index >= len(self.arena_sizes) or self.arena_sizes[index] != size:
            raise SharedStoreError(
                f"this rank lays out arena {index} with {size} bytes, the shared host store {self.name} "
                f"has {self.arena_sizes[index] if index < len(self.arena_sizes) else 'no such arena'}: the "
                "ranks load different models or settings. Give every rank the same arguments."
            )
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._damaged(path, size, 0) from None
        try:
            held = os.fstat(fd).st_size
            if held < size:  # mapping it would fault (SIGBUS) on the first page past the end
                raise self._damaged(path, size, held)
            self._maps[index] = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        return self._maps[index]

    def _damaged(self, path: Path, size: int, held: int) -> SharedStoreError:
        what = f"holds {held} of its {size} bytes" if held else "is gone"
        return SharedStoreError(
            f"the shared host store {self.name}'s arena file {path} {what}: something truncated or removed "
            "it after it was built (a full or cleaned shared-memory folder, or another process). Stop the "
            f"ranks that use it, remove {self.folder / self.name}.*, and start again; or load with "
            "share_host_store=False"
        )

    def _reserve(self, fd: int, index: int, size: int) -> None:
        """Allocate the arena's pages now, rather than as the builder writes them: a page of
        a sparse file that the folder cannot back kills the writing process with SIGBUS."""
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            self.arena_path(index).unlink(missing_ok=True)
            free = free_bytes(self.folder)
            raise self._no_room(max(self.needed or 0, sum(self.arena_sizes) + size), free, f" ({exc})") from exc

    def writable(self, index: int) -> Optional[mmap.mmap]:
        """The builder's writable mapping of arena ``index``; None on the other ranks."""
        return self._writers.get(index)

    def check_layer(self, position: int, layout: dict) -> None:
        """A follower's layer must be where, and laid out as, the builder put it (and, with
        ``verify``, hold the bytes it wrote)."""
        if self.builder:
            return
        layers = self.manifest["layers"]
        theirs = layers[position] if position < len(layers) else None
        if theirs != layout:
            raise SharedStoreError(
                f"layer {layout.get('name')} is laid out differently here than in the shared host store "
                f"{self.name} ({layout} here, {theirs} there): the ranks load different models or "
                "settings. Give every rank the same arguments."
            )
        if self.verify and self._checksum(layout) != self.manifest["checksums"][position]:
            raise SharedStoreError(
                f"layer {layout['name']} in the shared host store {self.name} ({self.folder}) does not hold the "
                "bytes the building rank wrote (its checksum differs): another process modified the segment. "
                f"Stop every rank of this run, remove {self.folder / self.name}.*, and run again."
            )

    def _checksum(self, layout: dict) -> int:
        """The checksum of a layer's bytes as mapped here (the debug checksums' sum of words)."""
        return checksum_of(self._maps[layout["arena"]], layout["offset"], layout["nbytes"])

    def complete(self, layers: List[dict]) -> None:
        """The builder publishes the layout: the others may map the arenas from now on."""
        if not self.builder:
            if len(layers) != len(self.manifest["layers"]):
                raise SharedStoreError(
                    f"this rank has {len(layers)} streamed layers, the shared host store {self.name} has "
                    f"{len(self.manifest['layers'])}. Give every rank the same arguments."
                )
            return
        for writer in self._writers.values():
            writer.flush()
            writer.close()
        self._writers.clear()
        checksums = [self._checksum(layout) for layout in layers]  # what a joining rank with verify checks
        manifest = {"name": self.name, "arenas": self.arena_sizes, "layers": layers, "checksums": checksums}
        temporary = self.path(f"manifest.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(manifest))
        os.replace(temporary, self.path("manifest"))
        self.manifest = manifest
        self._release_claim()  # after the manifest: a waiting rank never sees a free claim without one

    def _release_claim(self) -> None:
        if self._claim_fd is not None:
            os.close(self._claim_fd)
            self._claim_fd = None

    # -- leaving ------------------------------------------------------------------------------
    def leave(self) -> None:
        """Drop this rank's hold; the last rank to leave removes the segment. The mappings
        stay valid while tensors over them live (the files' pages go with the last map)."""
        if self._lock_fd is None:
            return
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        self._release_claim()
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
        self._lock_fd = None
        if self in _JOINED:
            _JOINED.remove(self)
        _remove_if_unused(self.path("lock"))


def join_for_load(
    setting,
    on_disk: bool,
    files: Iterable[Path],
    settings: dict,
    needed: Optional[int] = None,
    verify: bool = False,
) -> Optional[Segment]:
    """The node's segment for a load (joined: built here, or waited for until another rank
    built it), or None when each rank keeps its own store. ``setting``: share_host_store;
    ``on_disk``: host_budget puts layers on disk (the disk tier is per rank); ``settings``:
    what decides the bytes besides the files (dtype, quantisation, arena size); ``needed``:
    the store's bytes, which the builder refuses when the folder has no room for them;
    ``verify``: a joining rank checks each layer against the builder's checksums."""
    if not wanted(setting):
        return None
    if on_disk:
        if setting is True:
            raise LoadingError(
                "share_host_store=True with host_budget: the disk tier is per rank; leave "
                "host_budget unset to share the host store, or share_host_store unset."
            )
        logger.warning(
            "layerstream: share_host_store is off because host_budget puts layers on disk: every "
            "rank of this node builds its own host store (host RAM grows with the number of ranks)."
        )
        return None
    name = PREFIX + fingerprint(sorted(set(files)), **settings)
    segment = Segment(name, verify=verify).join(needed=needed)
    logger.info(
        "layerstream: %s the shared host store %s",
        "building" if segment.builder else "mapping",
        segment.folder / name,
        main_process_only=False,
    )
    return segment


_JOINED: List[Segment] = []


@atexit.register
def leave_all() -> None:
    """Leave every segment this process joined (at exit; a crash leaves them to the kernel's
    lock release and the next ``sweep``)."""
    for segment in list(_JOINED):
        segment.leave()
