"""Host RAM is checked before any weight is copied or page-locked: a store the host cannot
hold, or should not lock, stops with the sizes and what to change."""

import pytest
import torch

import layerstream
from layerstream.tiers import store as store_mod
from layerstream.tiers.store import HostMemoryError, check_host_memory

from tiny import peft_pair, save_tiny

GiB = 1 << 30


def _host(monkeypatch, available, total):
    monkeypatch.setattr(store_mod, "host_memory", lambda: (available, total))


def test_streaming_more_than_the_host_has_free_is_refused_before_any_copy(monkeypatch):
    model, _ = peft_pair("llama", layers=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _host(monkeypatch, available=1024, total=64 * GiB)
    with pytest.raises(HostMemoryError, match=r"streaming this model needs .* GiB more host RAM .* only 0.0 GiB"):
        layerstream.stream_model(model, device="cpu", slots=2)
    assert not layerstream.is_streamed(model)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), "nothing may have moved"


def test_page_locking_nearly_all_host_memory_is_refused(monkeypatch):
    _host(monkeypatch, available=31 * GiB, total=32 * GiB)
    with pytest.raises(HostMemoryError, match=r"would page-lock 30.0 GiB of this host's 32.0 GiB.*pin=False"):
        check_host_memory(1 * GiB, 30 * GiB, pin=True, what="streaming this model")


def test_pageable_stores_may_use_most_of_the_host(monkeypatch):
    _host(monkeypatch, available=31 * GiB, total=32 * GiB)
    check_host_memory(1 * GiB, 30 * GiB, pin=False, what="streaming this model")


def test_loading_checks_host_memory_before_reading_weights(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    save_tiny(directory, layers=3, dtype=torch.bfloat16)
    from layerstream.checkpoints import reader as tensor_reader

    read = []
    monkeypatch.setattr(tensor_reader.TensorReader, "__init__", lambda self, *args: read.append(args))
    _host(monkeypatch, available=1024, total=64 * GiB)
    with pytest.raises(HostMemoryError, match="loading this model needs"):
        layerstream.from_pretrained(
            directory, torch_dtype=torch.bfloat16, stream=layerstream.StreamConfig(device="cpu", slots=2)
        )
    assert not read, "no weight file may be opened before the check"


def _fake_root(tmp_path, cgroup: str, files: dict, meminfo=(60 * GiB, 64 * GiB)):
    """A root with /proc/meminfo of ``meminfo`` (available, total), /proc/self/cgroup holding
    ``cgroup``, and ``files`` (path under sys/fs/cgroup -> text)."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    available, total = meminfo
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: {total // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    for path, text in files.items():
        target = tmp_path / "sys" / "fs" / "cgroup" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return str(tmp_path)


def test_a_cgroup_v2_limit_below_the_hosts_is_what_the_process_may_use(tmp_path):
    from layerstream.system.memory_limits import host_memory

    root = _fake_root(
        tmp_path,
        "0::/job\n",
        {
            "job/memory.max": f"{16 * GiB}\n",
            "job/memory.current": f"{10 * GiB}\n",
            "job/memory.stat": f"anon {8 * GiB}\ninactive_file {2 * GiB}\n",
        },
    )
    assert host_memory(root) == (8 * GiB, 16 * GiB), "16 GiB limit, 10 in use of which 2 reclaimable"


def test_a_cgroup_v1_limit_is_read_where_the_container_sees_only_its_own_subtree(tmp_path):
    from layerstream.system.memory_limits import host_memory

    root = _fake_root(
        tmp_path,
        "5:cpu:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        {
            "memory/memory.limit_in_bytes": f"{8 * GiB}\n",
            "memory/memory.usage_in_bytes": f"{3 * GiB}\n",
            "memory/memory.stat": f"cache {2 * GiB}\ntotal_inactive_file {1 * GiB}\n",
        },
    )
    assert host_memory(root) == (6 * GiB, 8 * GiB)


def test_the_tightest_limit_on_the_way_up_counts(tmp_path):
    from layerstream.system.memory_limits import host_memory

    root = _fake_root(
        tmp_path,
        "0::/slice/job\n",
        {
            "slice/memory.max": f"{4 * GiB}\n",
            "slice/memory.current": f"{1 * GiB}\n",
            "slice/job/memory.max": "max\n",
            "slice/job/memory.current": f"{1 * GiB}\n",
        },
    )
    assert host_memory(root) == (3 * GiB, 4 * GiB)


@pytest.mark.parametrize(
    "cgroup, files",
    [
        ("0::/job\n", {"job/memory.max": "max\n", "job/memory.current": "1024\n"}),
        (
            "4:memory:/\n",
            {"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"},
        ),
        ("0::/job\n", {"job/memory.max": f"{128 * GiB}\n", "job/memory.current": "0\n"}),
        ("0::/job\n", {}),
    ],
    ids=["v2-unlimited", "v1-unlimited", "above-the-host", "no-files"],
)
def test_without_a_lower_limit_the_hosts_memory_stands(tmp_path, cgroup, files):
    """Negative control: the same reader keeps /proc/meminfo's numbers where no limit is lower."""
    from layerstream.system.memory_limits import host_memory

    assert host_memory(_fake_root(tmp_path, cgroup, files)) == (60 * GiB, 64 * GiB)


def test_page_locking_is_checked_against_the_containers_limit(tmp_path, monkeypatch):
    """A 1 GiB store any host allows is refused in a container of 2 GiB, through the
    reader of /proc/meminfo and the cgroup that every host-memory check uses."""
    from layerstream.system import memory_limits

    root = _fake_root(tmp_path, "0::/\n", {"memory.max": f"{2 * GiB}\n", "memory.current": f"{GiB // 2}\n"})
    reader = memory_limits.host_memory
    monkeypatch.setattr(memory_limits, "host_memory", lambda: reader(root))
    check_host_memory(GiB // 4, GiB, pin=False, what="streaming this model")
    with pytest.raises(HostMemoryError, match=r"page-lock 1.0 GiB of this host's 2.0 GiB"):
        check_host_memory(GiB // 4, GiB, pin=True, what="streaming this model")
