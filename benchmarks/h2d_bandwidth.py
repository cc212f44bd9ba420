"""Host-to-device copy bandwidth, by how the copy is made.

The throughput bound divides a step's bytes by one number, the bandwidth of one large
pinned copy (``common.pinned_bandwidth``). This script asks whether the engine could copy
faster than that number: the host memory the engine uses (ordinary memory page-locked
with cudaHostRegister, not torch's pinned allocator), copies of one layer's size back to
back, and one layer's bytes split over several copy streams at once.

    python benchmarks/h2d_bandwidth.py [--layer-mib 416] [--layers 8] [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch

from layerstream.system.cudart import register_host, unregister_host  # page-locks as the engine's store does

from common import cuda_timer, median, write_result


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call, each call synchronised."""
    times = []
    for _ in range(repeats + 1):
        start = cuda_timer()
        fn()
        times.append(cuda_timer() - start)
    return median(times[1:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer-mib", type=int, default=416, help="one layer's bytes (Llama-3-8B bf16: 416 MiB)")
    parser.add_argument("--layers", type=int, default=8, help="layers copied back to back per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    layer = args.layer_mib << 20
    total = layer * args.layers
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host = torch.empty(total, dtype=torch.uint8)
    register_host(host)
    device = torch.empty(total, dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(4)]
    rows = {}

    def one_copy(source):
        return lambda: device.copy_(source, non_blocking=True)

    def per_layer(source, ways: int):
        """Each layer's bytes split into ``ways`` parts, part i on copy stream i."""
        part = layer // ways

        def run():
            for index in range(args.layers):
                base = index * layer
                for way in range(ways):
                    lo = base + way * part
                    hi = base + layer if way == ways - 1 else lo + part
                    with torch.cuda.stream(streams[way]):
                        device[lo:hi].copy_(source[lo:hi], non_blocking=True)
            for stream in streams[:ways]:
                torch.cuda.current_stream().wait_stream(stream)

        return run

    rows["pin_memory, one copy of all layers"] = timed(one_copy(pinned), args.repeats)
    rows["cudaHostRegister, one copy of all layers"] = timed(one_copy(host), args.repeats)
    for ways in (1, 2, 4):
        rows[f"cudaHostRegister, per layer, {ways} stream(s)"] = timed(per_layer(host, ways), args.repeats)
    result = {
        "layer_bytes": layer,
        "layers": args.layers,
        "repeats": args.repeats,
        "rows": [{"how": how, "seconds": s, "gbps": total / s / 1e9} for how, s in rows.items()],
    }
    print("| how | GB/s |\n| --- | --- |")
    for row in result["rows"]:
        print(f"| {row['how']} | {row['gbps']:.2f} |")
    unregister_host(host)
    write_result("h2d-bandwidth", result)


if __name__ == "__main__":
    main()
