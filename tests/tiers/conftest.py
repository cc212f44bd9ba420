"""Fixtures of the tiers' tests: a sharded float32 checkpoint for the disk tier, and a copy
of it a test may change."""

import pytest
import torch
from disk_runs import LAYERS

from tiny import save_tiny


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("disk") / "ckpt", layers=LAYERS, dtype=torch.float32, shard="60KB")


@pytest.fixture
def copy_of(checkpoint, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(checkpoint, target)
    return target
