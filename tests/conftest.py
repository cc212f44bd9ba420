import gc
import logging
import warnings

import pytest
import torch

from tiny import save_tiny

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.fail("gpu-marked test selected on a machine without CUDA")
    return request.param


@pytest.fixture
def sharded_checkpoint(tmp_path):
    """A 4-layer bf16 Llama checkpoint in several safetensors shards with an index, which a
    test may edit (its own copy)."""
    return save_tiny(tmp_path / "ckpt", layers=4, dtype=torch.bfloat16, wide=True, shard="100KB")


@pytest.fixture(autouse=True)
def _earlier_objects_frozen(_frozen_objects_collected_at_the_end):
    """Each test starts with what is alive frozen (gc.freeze: out of the cyclic collector's
    walks), the garbage of the tests before it collected first. The libraries imported
    (half a million objects) would otherwise be walked by every full collection, about half
    a second each: accelerate's at every Trainer.train, and the interpreter's own (about 200
    s of the pinned suite's 1,980). What a test makes is collected as before.

    The cost: an object alive at a test's start (a module fixture's, a cache's) that later
    becomes cyclic garbage is never collected while frozen, nor are its finalizers run.
    Measured over the whole pinned suite in one process: 1.85 million objects frozen at the
    end, of them 45,000 cyclic garbage (about 9 MiB with their tensors); the RSS after each
    test at most 0.92 GiB, 26 MiB above a run without freezing on average (117 at most, over
    tests/api, integrations, long, modules and runtime), and the same (666 MiB) in tests/tiers
    run alone either way. The session's end unfreezes and collects them
    (_frozen_objects_collected_at_the_end).

    Not where CUDA is available (the GPU suite): there a streamed model a module fixture
    made (it and its runtime refer to each other) would keep its device memory until the
    session's end once it became garbage, and later tests measure the device's memory."""
    if torch.cuda.is_available():
        return
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def _frozen_objects_collected_at_the_end():
    """After the last test, what the tests froze goes back to the collector and its garbage
    is collected, finalizers run (files closed, shared memory unlinked), as it would have
    been without freezing: the interpreter's exit never walks frozen objects."""
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    yield


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps its state in process-wide singletons (mixed precision, devices): a
    Trainer in one test must not decide how another test's Accelerator prepares a model."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _no_saved_tensor_hooks_left_behind():
    """Autograd's saved-tensor hook stack is process-wide: a hook a test leaves pushed
    changes what every later test's forward saves (a later backward fails or differs)."""
    yield
    left = torch._C._autograd._top_saved_tensors_default_hooks(True)
    assert left is None, f"this test left saved-tensor hooks pushed: {left}"


@pytest.fixture
def read_only(monkeypatch):
    """Makes directories read-only to this process, as a read-only mount would (the tests may
    run as root, whom permission bits do not stop): creating, opening for writing, renaming
    or removing a file in one fails with EROFS. Returns the function that adds a directory."""
    import errno
    import os

    folders = []
    real = {name: getattr(os, name) for name in ("open", "mkdir", "unlink", "replace", "rename")}

    def inside(path) -> bool:
        path = os.path.abspath(os.fspath(path))
        return any(path == folder or path.startswith(folder + os.sep) for folder in folders)

    def refused(path):
        return OSError(errno.EROFS, "Read-only file system", os.fspath(path))

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path):
            raise refused(path)
        return real["open"](path, flags, *args, **kwargs)

    def writing(name):
        def call(path, *args, **kwargs):
            if inside(path) or (name in ("replace", "rename") and inside(args[0])):
                raise refused(path)
            return real[name](path, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "open", open_)
    for name in ("mkdir", "unlink", "replace", "rename"):
        monkeypatch.setattr(os, name, writing(name))
    return lambda folder: folders.append(os.path.abspath(folder))


def pytest_addoption(parser):
    parser.addoption(
        "--shuffle-seed",
        type=int,
        default=None,
        help="run the selected tests in an order shuffled with this seed (a test that passes "
        "alone but fails after another one shows state leaking between them)",
    )


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle-seed")
    if seed is not None:
        import random

        random.Random(seed).shuffle(items)
