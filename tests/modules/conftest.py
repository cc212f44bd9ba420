"""Fixtures of the modules' tests: tiny gpt-oss checkpoints as published (experts in MXFP4)."""

import pytest
from packed_models import LAYERS, ROUTED

from tiny import save_mxfp4_gpt_oss


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_mxfp4_gpt_oss(tmp_path_factory.mktemp("packed") / "gpt-oss", layers=LAYERS)


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    """16 experts, 2 a token: a pass of a few tokens copies by need."""
    return save_mxfp4_gpt_oss(tmp_path_factory.mktemp("routed") / "gpt-oss", layers=LAYERS, experts=ROUTED)
