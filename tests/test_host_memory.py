"""Host RAM is checked before any weight is copied or page-locked: a store the host cannot
hold, or should not lock, stops with the sizes and what to change."""

import pytest
import torch

import layerstream
from layerstream import store as store_mod
from layerstream.store import HostMemoryError, check_host_memory

from tiny import peft_pair, tiny_model

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
    tiny_model("llama", layers=3, dtype=torch.bfloat16).save_pretrained(directory)
    from layerstream import loading

    read = []
    monkeypatch.setattr(loading._Reader, "__init__", lambda self, files: read.append(files))
    _host(monkeypatch, available=1024, total=64 * GiB)
    with pytest.raises(HostMemoryError, match="loading this model needs"):
        layerstream.from_pretrained(
            directory, torch_dtype=torch.bfloat16, stream=layerstream.StreamConfig(device="cpu", slots=2)
        )
    assert not read, "no weight file may be opened before the check"
