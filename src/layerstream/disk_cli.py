"""``layerstream plan``'s disk options: ``--host-ram`` and ``--disk-gbps`` add the disk term
to the plan (``plan.disk``), ``--measure-disk DIR`` measures a directory's sequential
direct-I/O read bandwidth with one and with several readers (``disk.measure_read_gbps``)."""

from __future__ import annotations

import argparse
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Tuple

from .units import GiB, MiB, parse_bytes


def add_disk_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument(
        "--host-ram",
        help="host RAM the layer store may use (StreamConfig host_budget), e.g. 48GiB: the layers "
        "beyond it are read from disk every time they are copied, and the plan adds the disk term",
    )
    plan.add_argument("--disk-gbps", type=float, help="the disk's read bandwidth in GB/s (measure it: --measure-disk)")
    plan.add_argument(
        "--tflops",
        type=float,
        help="achieved TFLOP/s of the frozen layers' compute: the plan then predicts the step's compute "
        "and the tokens per step from which the disk reads hide behind it",
    )
    plan.add_argument(
        "--measure-disk",
        metavar="DIR",
        help="measure sequential direct-I/O read bandwidth in DIR (one and several readers) and exit",
    )
    plan.add_argument("--measure-bytes", default="1GiB", help="size of the file --measure-disk writes (default 1GiB)")


def measure_disk(args, parser: argparse.ArgumentParser) -> int:
    from .disk import READERS

    try:
        size = parse_bytes(args.measure_bytes)
        for readers in (1, READERS):
            gbps, direct = measure_read_gbps(args.measure_disk, size, readers)
            io = "direct I/O" if direct else "buffered I/O (O_DIRECT refused: the page cache was dropped first)"
            print(f"{args.measure_disk}: {gbps:.2f} GB/s sequential read, {readers} reader(s), {io}")
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    return 0


def format_disk_term(args, config, plan) -> str:
    from .plan import layer_bytes, layer_shapes
    from .plan.disk import disk_term, tokens_that_hide_the_disk

    if not args.disk_gbps:
        raise ValueError("--host-ram needs --disk-gbps (measure it with --measure-disk DIR)")
    sizes = layer_bytes(config, args.quantization, args.dtype)
    params = sum(linear.in_features * linear.out_features for shape in layer_shapes(config) for linear in shape.linears)
    term = disk_term(
        sizes,
        parse_bytes(args.host_ram),
        plan.slots,
        args.disk_gbps,
        plan.copy_seconds_per_step,
        params,
        args.seq * args.batch,
        args.tflops,
    )
    tiers = term.tiers
    lines = [
        "disk tier (host_budget {:.2f} GiB)".format(parse_bytes(args.host_ram) / GiB),
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


def measure_read_gbps(directory, size: int, readers: int, chunk: int = 8 * MiB) -> Tuple[float, bool]:
    """Sequential read bandwidth of a file of ``size`` bytes written in ``directory``, read in
    ``chunk``-byte aligned reads by ``readers`` threads; (GB/s, whether O_DIRECT was used).
    Where O_DIRECT is refused the file's cached pages are dropped first (posix_fadvise)."""
    from .disk import IO_ALIGN

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
        try:
            fd, direct = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), hasattr(os, "O_DIRECT")
        except OSError:
            fd, direct = os.open(path, os.O_RDONLY), False
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        local = __import__("threading").local()

        def read(offset: int) -> int:
            buffer = getattr(local, "buffer", None)
            if buffer is None:
                buffer = local.buffer = mmap.mmap(-1, chunk + IO_ALIGN)
            return os.preadv(fd, [memoryview(buffer)[:chunk]], offset)

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=readers) as pool:
            done = sum(pool.map(read, range(0, size, chunk)))
        seconds = time.perf_counter() - start
        os.close(fd)
        if done != size:
            raise OSError(f"read {done} of {size} bytes of {path}")
        return done / seconds / 1e9, direct
    finally:
        path.unlink(missing_ok=True)
