"""How much memory this process may use: the host's, or its container's where that is less.

``/proc/meminfo`` describes the whole host, but a container (docker, Kubernetes, a Slurm job)
runs under a cgroup memory limit that can be far lower, and page-locked memory counts
against it. Sizing the layer store, ``host_budget="auto"`` or the host-memory checks by the
host's numbers could choose a store the container cannot hold, and the kernel would kill
the process instead of layerstream refusing with a message. So the limit of the process's
cgroup, and of every cgroup above it, lowers both numbers: cgroup v2 (``memory.max``,
``memory.current``) and v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``). Usage
counts page cache the kernel can reclaim; its inactive file pages (``memory.stat``) are
taken off, as ``MemAvailable`` does for the host.

Every reader takes a ``root`` (``/`` by default) under which ``proc`` and ``sys`` are read,
so tests can point it at fake files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

# (limit file, usage file, memory.stat key of reclaimable file pages), per cgroup version
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def lockable_bytes(total: int) -> int:
    """The most page-locked memory a run may hold of a host (or container) of ``total``
    bytes: locked pages can be neither swapped nor reclaimed, so max(4 GiB, 10%) stays
    unlocked for everything else (the layer store, the ends and the offloaded inputs are
    page-locked; the store and the offloader refuse beyond it, and the plan counts it)."""
    return max(0, total - max(4 << 30, total // 10))


def host_memory(root: str = "/") -> Optional[Tuple[int, int]]:
    """(available, total) bytes this process may use: /proc/meminfo's MemAvailable and
    MemTotal, each lowered to the cgroup's where its limit is lower; None where /proc/meminfo
    cannot be read."""
    try:
        text = (Path(root) / "proc" / "meminfo").read_text()
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
        total = int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    limit = cgroup_memory(root)
    if limit is not None and limit[0] < total:
        total, available = limit[0], min(available, limit[1])
    return available, total


def cgroup_memory(root: str = "/") -> Optional[Tuple[int, int]]:
    """(limit, available under it) of the tightest memory limit on this process's cgroups,
    v2 or v1; None where no limit is set or none can be read."""
    found = None
    for folder, files in _cgroup_folders(Path(root)):
        reading = _read_limit(folder, files)
        if reading is not None and (found is None or reading[1] < found[1]):
            found = reading
    return found


def _cgroup_folders(root: Path) -> List[Tuple[Path, Tuple[str, str, str]]]:
    """The memory cgroup folders of this process, from its own up to the mount's root, each
    with the file names of its cgroup version."""
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    mounts = root / "sys" / "fs" / "cgroup"
    folders: List[Tuple[Path, Tuple[str, str, str]]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: "0::/path"
            base, files = mounts, _V2
        elif "memory" in controllers.split(","):
            base, files = mounts / "memory", _V1
        else:
            continue
        # a container without its own cgroup namespace sees the host's path for its cgroup,
        # while its mount shows only its own subtree: the folders that exist are the ones read
        here = base / path.lstrip("/")
        chain = [here, *here.parents]
        folders += [(folder, files) for folder in chain if folder.is_relative_to(base) and folder.is_dir()]
    return folders


def _read_limit(folder: Path, files: Tuple[str, str, str]) -> Optional[Tuple[int, int]]:
    """(limit, limit less what is in use and not reclaimable) of one cgroup folder; None
    without a limit ("max", or v1's page-rounded largest number, which no host reaches)."""
    limit_file, usage_file, inactive_key = files
    try:
        text = (folder / limit_file).read_text().strip()
        if text == "max":
            return None
        limit = int(text)
        usage = int((folder / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit >= 1 << 60:
        return None
    reclaimable = _stat(folder).get(inactive_key, 0)
    return limit, max(limit - max(usage - reclaimable, 0), 0)


def _stat(folder: Path) -> Dict[str, int]:
    try:
        lines = (folder / "memory.stat").read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    return values
