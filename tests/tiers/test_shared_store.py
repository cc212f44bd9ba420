"""The node's shared host store: the local ranks of a data-parallel run map one copy of the
frozen layers; the segment goes away with its last user, also after a SIGKILL; two
processes sharing it train like one process at the same global batch."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import get_peft_model

import layerstream
from layerstream.errors import StreamConfigError, StreamingError
from layerstream.tiers import shared_store

from tiny import batch, data_parallel_losses, lora_config, save_tiny

STEPS, GLOBAL_BATCH = 4, 4
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _segment_files(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(shared_store.PREFIX))


def _spawn(folder, code, name="layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5"):
    """A process that makes ``segment`` (``name`` in ``folder``) and runs ``code``."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from pathlib import Path
        from layerstream.tiers import shared_store
        segment = shared_store.Segment({name!r}, Path({str(folder)!r}), wait_seconds=30)
        """
    ) + textwrap.dedent(code)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(SRC))
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(path, process, seconds=30):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


BUILD = """
segment.join()
assert segment.builder
segment.new_arena(0, 4096)
segment.writable(0)[:4] = b"abcd"
Path({ready!r}).write_text("")
{then}
"""


def test_a_rank_that_dies_mid_build_is_named_and_its_segment_removed(tmp_path):
    builder = _spawn(tmp_path, BUILD.format(ready=str(tmp_path / "ready"), then="time.sleep(60)"))
    _wait_for(tmp_path / "ready", builder)
    assert shared_store.sweep(tmp_path) == [], "a segment in use is never removed"
    waiting, follower, errors = _join_in_thread(tmp_path)
    time.sleep(0.5)
    assert waiting.is_alive(), "the follower waits while the builder lives"
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    waiting.join(timeout=10)
    assert len(errors) == 1 and f"pid {builder.pid}" in str(errors[0]), errors
    assert "layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5.0.arena" in _segment_files(tmp_path)
    follower.leave()  # the last user leaves: nothing left behind
    assert _segment_files(tmp_path) == []
    # a new run after a dead build starts afresh rather than waiting on a dead pid
    fresh = shared_store.Segment("layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5", tmp_path).join()
    assert fresh.builder
    fresh.leave()


def _join_in_thread(folder, wait_seconds=30):
    """A follower joining segment ``layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5`` in a thread: (thread, segment, errors)."""
    follower = shared_store.Segment("layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5", folder, wait_seconds=wait_seconds)
    errors = []

    def wait():
        try:
            follower.join()
        except shared_store.SharedStoreError as exc:
            errors.append(exc)

    waiting = threading.Thread(target=wait)
    waiting.start()
    return waiting, follower, errors


def _a_dead_pid():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_live_builder_whose_pid_this_rank_cannot_see_is_waited_for(tmp_path):
    """Ranks in other pid namespaces (containers sharing /dev/shm) see another number for the
    builder's pid, or none: a follower must wait for a live build, not refuse it as dead."""
    go = tmp_path / "go"
    then = f"while not Path({str(go)!r}).exists(): time.sleep(0.05)\nsegment.complete([])"
    code = BUILD.format(ready=str(tmp_path / "ready"), then=then)
    builder = _spawn(tmp_path, f"os.getpid = lambda: {_a_dead_pid()}\n" + code)  # its pid as another namespace shows it
    _wait_for(tmp_path / "ready", builder)
    waiting, follower, errors = _join_in_thread(tmp_path)
    time.sleep(0.5)
    assert waiting.is_alive() and errors == [], f"a live build was refused: {errors}"
    go.write_text("")
    waiting.join(timeout=20)
    assert not waiting.is_alive() and errors == [] and not follower.builder
    assert bytes(follower.new_arena(0, 4096)[:4]) == b"abcd"
    assert builder.wait(timeout=20) == 0, builder.communicate()
    follower.leave()
    assert _segment_files(tmp_path) == []


def test_a_builder_killed_mid_write_is_refused_at_once_even_when_its_pid_lives_on(tmp_path):
    """The builder is killed after writing part of an arena and its pid is taken by a live
    process (reuse, or another pid namespace): the waiting rank refuses the partial segment
    at once rather than waiting for a build that will never finish; the next run builds afresh."""
    code = BUILD.format(ready=str(tmp_path / "ready"), then="time.sleep(60)")
    builder = _spawn(tmp_path, f"os.getpid = lambda: {os.getpid()}\n" + code)  # a pid that stays alive
    _wait_for(tmp_path / "ready", builder)
    waiting, follower, errors = _join_in_thread(tmp_path, wait_seconds=20)
    time.sleep(0.3)
    assert waiting.is_alive(), "the follower waits while the builder lives"
    started = time.monotonic()
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    waiting.join(timeout=30)
    assert len(errors) == 1 and time.monotonic() - started < 5, errors
    message = str(errors[0])
    assert "stopped before it finished" in message and "not used" in message and f"pid {os.getpid()}" in message
    follower.leave()
    assert _segment_files(tmp_path) == []
    fresh = shared_store.Segment("layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5", tmp_path).join()
    assert fresh.builder
    fresh.leave()


def test_the_sweep_removes_only_files_shaped_as_a_segments(tmp_path):
    """Files of the user's that start with the prefix stay, wherever LAYERSTREAM_SHM_DIR
    points; a segment nobody holds goes (control)."""
    theirs = ["layerstream-notes.txt", "layerstream-0.3.0.tar.gz", "layerstream-run.lock", "layerstream-results.json"]
    for file in theirs:
        (tmp_path / file).write_text("the user's")
    segment = shared_store.Segment("layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5", tmp_path).join()
    segment.new_arena(0, 4096)
    assert shared_store.sweep(tmp_path) == [], "a segment in use stays"
    segment.leave()
    (tmp_path / "layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5.0.arena").write_bytes(
        b"left by a sweep that died"
    )  # no lock beside it
    assert shared_store.sweep(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(theirs)


def test_segments_of_killed_ranks_are_swept_and_a_live_users_segment_is_kept(tmp_path):
    then = "segment.complete([]); time.sleep(60)"
    first = _spawn(tmp_path, BUILD.format(ready=str(tmp_path / "ready"), then=then))
    _wait_for(tmp_path / "layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5.manifest", first)
    second = _spawn(tmp_path, "segment.join(); assert not segment.builder; print('joined', flush=True); time.sleep(60)")
    assert second.stdout.readline().strip() == b"joined"
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert shared_store.sweep(tmp_path) == [], "the second rank still maps it"
    assert "layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5.0.arena" in _segment_files(tmp_path)
    second.send_signal(signal.SIGKILL)
    second.wait()
    assert "layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5.0.arena" in _segment_files(
        tmp_path
    )  # nobody left to remove it...
    assert shared_store.sweep(tmp_path) == [
        "layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5"
    ]  # ... until the next run starts
    assert _segment_files(tmp_path) == []


def test_the_last_rank_to_exit_removes_the_segment(tmp_path):
    then = "segment.complete([])"
    builder = _spawn(tmp_path, BUILD.format(ready=str(tmp_path / "ready"), then=then + "; time.sleep(1)"))
    _wait_for(tmp_path / "layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5.manifest", builder)
    follower = shared_store.Segment("layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5", tmp_path, wait_seconds=30).join()
    assert not follower.builder and follower.arena_sizes == [4096]
    assert bytes(follower.new_arena(0, 4096)[:4]) == b"abcd"  # the builder's pages
    assert builder.wait() == 0, builder.communicate()  # leaves at exit; we still hold it
    assert "layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5.0.arena" in _segment_files(tmp_path)
    follower.leave()
    assert _segment_files(tmp_path) == []


def test_a_follower_with_another_layout_is_refused(tmp_path):
    builder = shared_store.Segment("layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5", tmp_path).join()
    builder.new_arena(0, 4096)
    layout = {"name": "l0", "arena": 0, "offset": 0, "nbytes": 512, "entries": [[0, 512, [128], "torch.float32"]]}
    builder.complete([layout])
    follower = shared_store.Segment("layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5", tmp_path)
    follower._wait()  # as join does after losing the build claim
    follower.check_layer(0, layout)
    with pytest.raises(shared_store.SharedStoreError, match="laid out differently"):
        follower.check_layer(0, dict(layout, nbytes=1024))
    with pytest.raises(shared_store.SharedStoreError, match="arena 0 with 8192 bytes"):
        follower.new_arena(0, 8192)
    builder.leave()
    assert _segment_files(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncated", "removed"])
def test_an_arena_file_truncated_or_removed_after_the_build_is_refused_by_name(tmp_path, damage):
    """A follower maps the builder's arenas: one another process cut short (or deleted) is
    named with what to do, where mapping it would fail with a bare error or fault later."""
    builder = shared_store.Segment("layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5", tmp_path).join()
    builder.new_arena(0, 4096)
    layout = {"name": "l0", "arena": 0, "offset": 0, "nbytes": 512, "entries": [[0, 512, [128], "torch.float32"]]}
    builder.complete([layout])
    follower = shared_store.Segment("layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5", tmp_path)
    follower._wait()
    assert len(follower.new_arena(0, 4096)) == 4096, "control: the whole arena maps"
    arena = builder.arena_path(0)
    if damage == "truncated":
        os.truncate(arena, 100)
        expected = "holds 100 of its 4096 bytes"
    else:
        arena.unlink()
        expected = "is gone"
    late = shared_store.Segment("layerstream-5e9e57e55e9e57e55e9e57e55e9e57e5", tmp_path)
    late._wait()
    with pytest.raises(shared_store.SharedStoreError, match=rf"{arena}.*{expected}.*share_host_store=False"):
        late.new_arena(0, 4096)
    builder.leave()
    follower.leave()


def test_the_fingerprint_changes_with_the_checkpoint_and_the_settings(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    first = shared_store.fingerprint([weights], dtype="torch.float32")
    assert shared_store.fingerprint([weights], dtype="torch.float32") == first
    assert shared_store.fingerprint([weights], dtype="torch.bfloat16") != first
    os.utime(weights, ns=(1, 1))
    assert shared_store.fingerprint([weights], dtype="torch.float32") != first
    # another file of the same size copied over the name with the times kept (cp -p)
    before = shared_store.fingerprint([weights], dtype="torch.float32")
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"y" * 10)
    os.utime(other, ns=(1, 1))
    os.replace(other, weights)
    assert weights.stat().st_size == 10 and weights.stat().st_mtime_ns == 1
    assert shared_store.fingerprint([weights], dtype="torch.float32") != before


def test_the_setting_is_on_for_several_local_ranks_only():
    assert shared_store.wanted("auto", local_world_size=2)
    assert not shared_store.wanted("auto", local_world_size=1)
    assert shared_store.wanted(True, local_world_size=1) and not shared_store.wanted(False, local_world_size=8)
    with pytest.raises(StreamConfigError, match="share_host_store must be True, False or 'auto'"):
        layerstream.StreamConfig(device="cpu", share_host_store="yes please")


# -- two ranks of a data-parallel run ---------------------------------------------------------
def _checkpoint(directory):
    save_tiny(directory, layers=4)


def _load(checkpoint, share):
    config = layerstream.StreamConfig(device="cpu", slots=2, prefetch=1, vram_budget=None, share_host_store=share)
    model = layerstream.from_pretrained(checkpoint, dtype=torch.float32, stream=config)
    torch.manual_seed(0)  # the same non-zero LoRA B on every rank
    return get_peft_model(model, lora_config())


def _in_shared_file(model, folder) -> bool:
    """Whether every streamed layer's host bytes lie in a mapping of a file in ``folder``."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(str(folder)):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                spans.append((low, high))
    records = layerstream.get_runtime(model).records
    return bool(spans) and all(
        any(low <= r.host_region.data_ptr() and r.host_region.data_ptr() + r.nbytes <= high for low, high in spans)
        for r in records
    )


def _worker(rank, world, rendezvous, checkpoint, folder, out, local_world=None):
    """One data-parallel rank; with ``local_world`` < ``world``, ranks stand in for nodes of
    ``local_world`` ranks each, every node with a shared-memory folder of its own (as each
    machine has its own /dev/shm) and torchrun's per-node variables."""
    from torch.nn.parallel import DistributedDataParallel

    local_world = local_world or world
    node, local_rank = divmod(rank, local_world)
    os.environ.update(
        LOCAL_RANK=str(local_rank),
        RANK=str(rank),
        LOCAL_WORLD_SIZE=str(local_world),
        WORLD_SIZE=str(world),
        GROUP_RANK=str(node),
    )
    folder = folder if local_world == world else os.path.join(folder, f"node{node}")
    os.environ["LAYERSTREAM_SHM_DIR"] = folder
    if local_rank == 1:
        time.sleep(1)  # let local rank 0 claim the build; the other order works the same
    model = _load(checkpoint, "auto")  # before the process group exists, as a script may
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        segment = layerstream.get_runtime(model).store.segment
        facts = {"builder": segment.builder, "shared": _in_shared_file(model, folder), "name": segment.name}
        losses = data_parallel_losses(DistributedDataParallel(model), STEPS, GLOBAL_BATCH, rank, world)
        torch.save({"losses": losses, "folder": folder, **facts}, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    shared_store.leave_all()  # what the interpreter's exit does; os._exit skips it
    os._exit(0)


def _spawn_ranks(nprocs, args, what):
    context = mp.spawn(_worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {what} did not finish within 240 s")


def test_two_ranks_share_one_store_and_train_like_one_process(tmp_path):
    checkpoint, folder = tmp_path / "ckpt", tmp_path / "shm"
    _checkpoint(checkpoint)
    single_model = _load(checkpoint, "auto")  # one local rank: not shared
    assert layerstream.get_runtime(single_model).store.segment is None
    assert not _in_shared_file(single_model, folder), "the check must fail for a store of one's own"
    single = data_parallel_losses(single_model, STEPS, GLOBAL_BATCH)
    out = tmp_path / "result"
    args = (2, str(tmp_path / "rendezvous"), str(checkpoint), str(folder), str(out))
    _spawn_ranks(2, args, "two data-parallel processes")
    first, second = (torch.load(f"{out}.{rank}") for rank in range(2))
    # the first to arrive builds (usually local rank 0, which the other waits a second for; on
    # a loaded host rank 1 can still come first, and works the same)
    assert first["builder"] != second["builder"] and first["name"] == second["name"], "one build, one mapping"
    assert first["shared"] and second["shared"], "each rank's layers lie in the one shared file"
    print("single", single, "two ranks", first["losses"])
    assert torch.allclose(torch.tensor(first["losses"]), torch.tensor(single), rtol=1e-5, atol=1e-6)
    assert first["losses"] == second["losses"] and first["losses"][-1] < first["losses"][0]
    assert _segment_files(folder) == [], "the last rank to leave removes the segment"


def test_two_nodes_of_two_ranks_build_one_store_per_node_and_train_like_one_process(tmp_path):
    """Multi-node is torchrun's and Accelerate's: four gloo processes stand in for two nodes
    of two ranks, each node with its own shared-memory folder. Each node builds its store
    once (the first of its ranks to arrive), its other rank maps it, and the losses are one process's."""
    checkpoint, folder = tmp_path / "ckpt", tmp_path / "shm"
    _checkpoint(checkpoint)
    single = data_parallel_losses(_load(checkpoint, "auto"), STEPS, GLOBAL_BATCH)
    out = tmp_path / "result"
    _spawn_ranks(4, (4, str(tmp_path / "rendezvous"), str(checkpoint), str(folder), str(out), 2), "four processes")
    ranks = [torch.load(f"{out}.{rank}") for rank in range(4)]
    assert [ranks[0]["builder"] + ranks[1]["builder"], ranks[2]["builder"] + ranks[3]["builder"]] == [1, 1], (
        "one build per node"
    )
    assert ranks[0]["folder"] != ranks[2]["folder"] and ranks[0]["folder"] == ranks[1]["folder"]
    assert all(r["shared"] for r in ranks), "each rank's layers lie in its node's shared file"
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    assert torch.allclose(torch.tensor(ranks[0]["losses"]), torch.tensor(single), rtol=1e-5, atol=1e-6)
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    for node in (0, 1):
        assert _segment_files(folder / f"node{node}") == [], "each node's last rank removes its segment"


def test_a_merge_into_a_shared_store_is_refused_before_anything_changes(tmp_path, monkeypatch):
    """The shared pages are read-only and other ranks read them: a PEFT merge must stop
    with a clear error, not crash on the write, and leave the model as it was."""
    checkpoint = tmp_path / "ckpt"
    _checkpoint(checkpoint)
    monkeypatch.setenv("LAYERSTREAM_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    model = _load(checkpoint, True)
    assert layerstream.get_runtime(model).store.segment is not None
    ids = batch(96, size=2, seq=8)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    with pytest.raises(StreamingError, match="shared by this node's ranks"):
        model.merge_adapter()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    shared_store.leave_all()


# -- a segment modified by another process --------------------------------------------------------
def _shared_checkpoint(tmp_path, monkeypatch):
    checkpoint, folder = tmp_path / "ckpt", tmp_path / "shm"
    _checkpoint(checkpoint)
    folder.mkdir()
    monkeypatch.setenv("LAYERSTREAM_SHM_DIR", str(folder))
    return checkpoint, folder


def _plain(checkpoint, share, checksum=False):
    config = layerstream.StreamConfig(
        device="cpu", slots=2, prefetch=1, vram_budget=None, share_host_store=share, checksum=checksum
    )
    return layerstream.from_pretrained(checkpoint, dtype=torch.float32, stream=config)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=batch(96, size=2, seq=8)).logits


def _modify_a_layer_in_the_segment(folder, position=1):
    """Another process of the same user writes into layer ``position``'s bytes in the arena file."""
    (manifest,) = folder.glob("*.manifest")
    layout = json.loads(manifest.read_text())["layers"][position]
    arena = folder / f"{manifest.name[: -len('.manifest')]}.{layout['arena']}.arena"
    with open(arena, "r+b") as handle:
        handle.seek(layout["offset"] + 10)
        value = handle.read(1)[0]
        handle.seek(layout["offset"] + 10)
        handle.write(bytes([value ^ 0x40]))
    return layout["name"]


def test_a_rank_joining_with_checksums_refuses_a_segment_another_process_modified(tmp_path, monkeypatch):
    checkpoint, folder = _shared_checkpoint(tmp_path, monkeypatch)
    _plain(checkpoint, True)  # the builder
    name = _modify_a_layer_in_the_segment(folder)
    with pytest.raises(shared_store.SharedStoreError, match=rf"{name} in the shared host store .* another process"):
        _plain(checkpoint, True, checksum=True)
    shared_store.leave_all()


def test_without_checksums_a_joining_rank_maps_the_modified_bytes_negative_control(tmp_path, monkeypatch):
    """What checksum=False does not protect against: the joining rank computes with the bytes
    another process wrote into the segment."""
    checkpoint, folder = _shared_checkpoint(tmp_path, monkeypatch)
    _plain(checkpoint, True)
    _modify_a_layer_in_the_segment(folder)
    joined = _plain(checkpoint, True, checksum=False)
    assert not torch.equal(_logits(joined), _logits(_plain(checkpoint, False)))
    shared_store.leave_all()


def test_a_rank_joining_an_unmodified_segment_with_checksums_computes_exactly(tmp_path, monkeypatch):
    checkpoint, folder = _shared_checkpoint(tmp_path, monkeypatch)
    builder = _plain(checkpoint, True)
    joined = _plain(checkpoint, True, checksum=True)
    assert not layerstream.get_runtime(joined).store.segment.builder
    assert torch.equal(_logits(joined), _logits(_plain(checkpoint, False)))
    assert torch.equal(_logits(builder), _logits(joined))
    shared_store.leave_all()


def test_a_segment_whose_builder_was_killed_mid_write_is_rebuilt_not_mapped(tmp_path, monkeypatch):
    """A builder killed part way through writing the store's arena leaves the segment's files
    behind: the next load of the same checkpoint builds the store afresh and computes as an
    unshared one. Control: the bytes the killed builder left would change the logits."""
    checkpoint, folder = _shared_checkpoint(tmp_path, monkeypatch)
    resident = _logits(_plain(checkpoint, False))
    segment = layerstream.get_runtime(_plain(checkpoint, True)).store.segment
    name, (size,) = segment.name, segment.arena_sizes  # the name a load of this checkpoint uses
    shared_store.leave_all()
    assert _segment_files(folder) == []
    ready = tmp_path / "ready"
    code = f"""
    segment.join()
    assert segment.builder
    segment.new_arena(0, {size})
    segment.writable(0)[: {size // 2}] = bytes(range(256)) * {size // 512}  # half the arena, other bytes
    Path({str(ready)!r}).write_text("")
    time.sleep(60)
    """
    builder = _spawn(folder, textwrap.dedent(code), name=name)
    _wait_for(ready, builder)
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    arena = folder / f"{name}.0.arena"
    left = arena.read_bytes()
    assert not (folder / f"{name}.manifest").exists() and len(left) == size
    rebuilt = _plain(checkpoint, True)
    assert layerstream.get_runtime(rebuilt).store.segment.builder, "built afresh, not mapped"
    assert torch.equal(_logits(rebuilt), resident)
    arena.write_bytes(left)  # control: what mapping the killed builder's arena would compute
    assert not torch.equal(_logits(rebuilt), resident)
    shared_store.leave_all()
    assert _segment_files(folder) == []


# -- a shared-memory folder too small for the store ------------------------------------------
def _segment_refused(tmp_path, monkeypatch):
    """A checkpoint, an empty shared-memory folder, and the layers the load stores."""
    from layerstream.tiers.store import HostStore

    checkpoint, folder = _shared_checkpoint(tmp_path, monkeypatch)
    stored, add = [], HostStore.add

    def counted(self, record, *args, **kwargs):
        stored.append(record)
        return add(self, record, *args, **kwargs)

    monkeypatch.setattr(HostStore, "add", counted)
    return checkpoint, folder, stored


def test_a_store_larger_than_the_free_shared_memory_is_refused_before_any_layer_loads(tmp_path, monkeypatch):
    """Docker gives a container 64 MiB of /dev/shm: a store that does not fit would be killed by
    SIGBUS part way through its build, leaving its segment behind. It is refused before any
    layer is read, saying what it needs, what is free and what to do, and leaves nothing; the
    same load with room (the control) shares its store and computes as an unshared one."""
    from types import SimpleNamespace

    checkpoint, folder, stored = _segment_refused(tmp_path, monkeypatch)
    statvfs = os.statvfs
    monkeypatch.setattr(
        os,
        "statvfs",
        lambda where: SimpleNamespace(f_bavail=16, f_frsize=4096) if str(where) == str(folder) else statvfs(where),
    )
    with pytest.raises(shared_store.SharedStoreError) as refused:
        _load(checkpoint, True)
    message = str(refused.value)
    assert str(folder) in message and "64.00 KiB free" in message and "SIGBUS" in message
    assert "--shm-size=" in message and "LAYERSTREAM_SHM_DIR" in message and "share_host_store=False" in message
    assert stored == [] and _segment_files(folder) == []
    monkeypatch.undo()  # the folder's real free space from here on
    monkeypatch.setenv("LAYERSTREAM_SHM_DIR", str(folder))
    shared, alone = _load(checkpoint, True), _load(checkpoint, False)
    assert layerstream.get_runtime(shared).store.segment is not None
    ids = batch(96, size=2, seq=8)
    with torch.no_grad():
        assert torch.equal(shared(input_ids=ids).logits, alone(input_ids=ids).logits)
    shared_store.leave_all()
    assert _segment_files(folder) == []


def test_an_arena_the_shared_memory_cannot_back_is_refused_and_its_segment_removed(tmp_path, monkeypatch):
    """The space check passed but the allocation of an arena fails (another process filled
    /dev/shm meanwhile): the arena's pages are allocated before any is written, so the load
    stops with the same error instead of SIGBUS, and its segment is removed."""
    import errno

    checkpoint, folder, _ = _segment_refused(tmp_path, monkeypatch)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(shared_store.SharedStoreError, match="No space left on device") as refused:
        _load(checkpoint, True)
    assert "--shm-size=" in str(refused.value) and "share_host_store=False" in str(refused.value)
    assert _segment_files(folder) == []


def test_a_shared_memory_folder_that_cannot_be_written_is_named_before_any_layer_loads(
    tmp_path, monkeypatch, read_only
):
    """A read-only LAYERSTREAM_SHM_DIR (or /dev/shm) stops the load with the folder and what to
    do, not a bare OSError, before any layer is read."""
    checkpoint, folder, stored = _segment_refused(tmp_path, monkeypatch)
    read_only(folder)
    with pytest.raises(shared_store.SharedStoreError, match="Read-only file system") as refused:
        _load(checkpoint, True)
    message = str(refused.value)
    assert str(folder) in message and "LAYERSTREAM_SHM_DIR" in message and "share_host_store=False" in message
    assert stored == [] and _segment_files(folder) == []
