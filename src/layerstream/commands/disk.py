"""``layerstream plan``'s disk options: ``--host-budget`` and ``--disk-gbps`` add the disk term
to the plan (``plan.disk``), ``--measure-disk DIR`` measures a directory's sequential
direct-I/O read bandwidth with one and with several readers: of the checkpoint or NF4 cache
files in it where it holds some (``measure_files_gbps``: the bytes a disk tier reads), else
of a file it writes (``measure_read_gbps``).

Why the checkpoint's own files when there are some: a file just written can be read back
from a cache in front of the disk (the drive's, or a virtual machine host's) much faster
than bytes written long ago, and a disk tier reads far more bytes per step than such a cache
holds, so a fresh file can promise a bandwidth the run never sees."""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..units import GiB, parse_bytes


def add_disk_arguments(plan: argparse.ArgumentParser) -> None:
    """The disk term's own flags; its host budget is StreamConfig's ``--host-budget``."""
    plan.add_argument(
        "--disk-gbps",
        type=float,
        help="the disk's read bandwidth in GB/s (measure it: --measure-disk): with --host-budget, the "
        "layers beyond it are read from disk every time they are copied, and the plan adds the disk term",
    )
    plan.add_argument(
        "--tflops",
        type=float,
        help="achieved TFLOP/s of the frozen layers' compute: the plan then predicts the step's compute "
        "and the tokens per step from which the disk reads hide behind it",
    )
    plan.add_argument(
        "--measure-disk",
        metavar="DIR",
        help="measure sequential direct-I/O read bandwidth in DIR (one and several readers) and exit: "
        "of the checkpoint (*.safetensors) or NF4 cache (*.nf4) files in DIR where it holds some, "
        "else of a file it writes there",
    )
    plan.add_argument(
        "--measure-bytes", default="1GiB", help="bytes --measure-disk reads per reader count (default 1GiB)"
    )


def measure_disk(args, parser: argparse.ArgumentParser) -> int:
    from ..tiers.disk import READERS

    try:
        size = parse_bytes(args.measure_bytes)
        own = stored_layer_files(args.measure_disk)
        # each count reads other files than the one before, where there are enough
        parts = [own[: len(own) // 2], own[len(own) // 2 :]] if len(own) > 1 else [own, own]
        for readers, files in zip((1, READERS), parts):
            if own:
                gbps, direct, done = measure_files_gbps(files, size, readers)
                what = f"{done / GiB:.2f} GiB of {len(files)} stored file(s)"
            else:
                gbps, direct = measure_read_gbps(args.measure_disk, size, readers)
                what = "a file just written (a cache in front of the disk may serve it faster)"
            io = "direct I/O" if direct else "buffered I/O (O_DIRECT refused: the page cache was dropped first)"
            print(f"{args.measure_disk}: {gbps:.2f} GB/s sequential read, {readers} reader(s), {io}, {what}")
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    return 0


def stored_layer_files(directory) -> List[Path]:
    """The files a disk tier would read in ``directory``: the layer files of an NF4 cache in it
    (``nf4-cache/``), else its safetensors shards; largest first."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"--measure-disk {directory}: no such directory")
    # a complete NF4 cache is what the tier reads (the checkpoint's layers are not read then)
    found = sorted(folder.glob("*.nf4")) + sorted(folder.glob("*/*.nf4")) or sorted(folder.glob("*.safetensors"))
    return sorted(found, key=lambda path: -path.stat().st_size)


def disk_tier(args, config, plan, host_budget: int):
    """The disk term of ``plan`` with a layer store of ``host_budget`` bytes in host RAM, the
    frozen linear parameters it computes over, and the host store that tier keeps (its RAM
    layers and staging ring; ``plan.longest.HostStore``), for the host check: ``(term,
    params, store)``. The tiers do not depend on the sequence, so ``store`` holds for a plan
    of any length."""
    from ..plan import layer_bytes, layer_shapes
    from ..plan.disk import disk_term, with_disk_store

    if not args.disk_gbps:
        raise ValueError("--host-budget needs --disk-gbps (measure it with --measure-disk DIR)")
    sizes = layer_bytes(config, args.quantization, args.dtype)
    params = sum(linear.in_features * linear.out_features for shape in layer_shapes(config) for linear in shape.linears)
    term = disk_term(
        sizes,
        host_budget,
        plan.slots,
        args.disk_gbps,
        plan.copy_seconds_per_step,
        params,
        plan.seq * plan.batch,
        args.tflops,
        quantized=args.quantization == "nf4",
    )
    return term, params, functools.partial(with_disk_store, sizes=sizes, tiers=term.tiers)


def format_disk_term(args, term, params: int, host_budget: int) -> str:
    """``disk_tier``'s term as the plan prints it."""
    from ..plan.disk import tokens_that_hide_the_disk

    tiers = term.tiers
    lines = [
        "disk tier (host_budget {:.2f} GiB)".format(host_budget / GiB),
        f"  tiers        {len(tiers.ram)} layer(s) in host RAM, {len(tiers.disk)} read from disk, ring "
        f"{tiers.ring_regions} x {tiers.region_bytes / GiB:.3f} GiB",
        f"  disk reads   {term.disk_bytes_per_step / GiB:.2f} GiB per step, {term.disk_seconds:.3f} s at "
        f"{args.disk_gbps:g} GB/s",
        f"  copies       {term.copy_seconds:.3f} s per step",
    ]
    if term.compute_seconds is not None:
        lines.append(f"  compute      {term.compute_seconds:.3f} s per step at {args.tflops:g} TFLOP/s")
        if tiers.disk:
            hide = tokens_that_hide_the_disk(term, params, args.tflops)
            lines.append(f"  the disk hides behind compute from {hide} tokens per step")
    lines.append(f"  step         at least {term.step_seconds:.3f} s")
    return "\n".join(lines)


def measure_read_gbps(directory, size: int, readers: int, chunk: Optional[int] = None) -> Tuple[float, bool]:
    """Sequential read bandwidth of a file of ``size`` bytes written in ``directory``, read in
    ``chunk``-byte aligned reads by ``readers`` threads; (GB/s, whether O_DIRECT was used).
    Where O_DIRECT is refused the file's cached pages are dropped first (posix_fadvise).
    ``chunk`` defaults to the disk tier's read size."""
    from ..tiers.disk import CHUNK_BYTES

    chunk = chunk or CHUNK_BYTES
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"--measure-disk {directory}: no such directory")
    size = max(size // chunk, 1) * chunk
    path = folder / ".layerstream-disk-probe"
    try:
        block = os.urandom(chunk)
        with open(path, "wb") as handle:
            for _ in range(size // chunk):
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
        gbps, direct, done = measure_files_gbps([path], size, readers, chunk)
        if done != size:
            raise OSError(f"read {done} of {size} bytes of {path}")
        return gbps, direct
    finally:
        path.unlink(missing_ok=True)


def measure_files_gbps(
    paths: Sequence[Path], size: int, readers: int, chunk: Optional[int] = None
) -> Tuple[float, bool, int]:
    """Read bandwidth of about ``size`` bytes of existing files (whole chunks), file after file
    from their start, in ``chunk``-byte aligned reads (default: the disk tier's read size) by
    ``readers`` threads; (GB/s, whether O_DIRECT was used for all, bytes read)."""
    from ..tiers.disk import CHUNK_BYTES, IO_ALIGN

    chunk = chunk or CHUNK_BYTES
    jobs: List[Tuple[int, int]] = []  # (descriptor, offset)
    descriptors, direct = [], True
    try:
        planned = 0
        for path in paths:
            if planned >= size:
                break
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                direct = direct and hasattr(os, "O_DIRECT")
            except OSError:
                fd, direct = os.open(path, os.O_RDONLY), False
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            descriptors.append(fd)
            length = os.fstat(fd).st_size
            for offset in range(0, length, chunk):
                if planned >= size:
                    break
                jobs.append((fd, offset))
                planned += min(chunk, length - offset)
        if not jobs:
            raise ValueError(
                f"nothing to read in {[str(p) for p in paths]} (empty files, or --measure-bytes too small)"
            )
        local = __import__("threading").local()

        def read(job: Tuple[int, int]) -> int:
            buffer = getattr(local, "buffer", None)
            if buffer is None:
                buffer = local.buffer = mmap.mmap(-1, chunk + IO_ALIGN)  # page-aligned: fit for O_DIRECT
            return os.preadv(job[0], [memoryview(buffer)[:chunk]], job[1])

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=readers) as pool:
            done = sum(pool.map(read, jobs))
        seconds = time.perf_counter() - start
    finally:
        for fd in descriptors:
            os.close(fd)
    return done / seconds / 1e9, direct, done
