"""The CUDA runtime layerstream calls directly is the one torch uses: chosen by its soname's
major among the runtimes mapped into the process and confirmed by cudaRuntimeGetVersion;
where it cannot be told, nothing is bound and one warning says so (torch's calls are used)."""

import logging

import pytest

from layerstream.system import cudart


def _maps(*paths):
    return [f"7f0000000000-7f0000100000 r-xp 00000000 08:01 {i} {path}\n" for i, path in enumerate(paths, 1)]


TORCH = "/venv/nvidia/cu13/lib/libcudart.so.13"
CUPY = "/venv/cupy_backends/lib/libcudart.so.12"


def test_the_runtime_with_torchs_cuda_major_is_chosen_beside_another():
    maps = _maps(CUPY, TORCH, TORCH, "/usr/lib/libc.so.6")  # a file maps several segments
    assert cudart.choose_runtime(maps, "13.0") == (TORCH, "")
    assert cudart.choose_runtime(maps, "12.8") == (CUPY, "")


@pytest.mark.parametrize(
    "maps, cuda, doubt",
    [
        (_maps(CUPY), "13.0", "no CUDA runtime mapped into this process is torch's CUDA 13"),
        (_maps(TORCH, "/other/lib/libcudart.so.13.0.96"), "13.0", "several CUDA runtimes"),
        (_maps("/opt/lib/libcudart.so"), "13.0", "no CUDA runtime mapped into this process is torch's CUDA 13"),
    ],
    ids=["another-major", "two-of-torchs-major", "no-soname-major"],
)
def test_a_runtime_that_cannot_be_told_to_be_torchs_is_not_chosen(maps, cuda, doubt):
    path, why = cudart.choose_runtime(maps, cuda)
    assert path is None and doubt in why


def test_nothing_to_choose_is_no_doubt():
    assert cudart.choose_runtime(_maps("/usr/lib/libc.so.6"), "13.0") == (None, ""), "a static runtime"
    assert cudart.choose_runtime(_maps(TORCH), None) == (None, ""), "a CPU build of torch"


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(cudart, "_runtime", None)
    monkeypatch.setattr(cudart, "_looked", False)
    monkeypatch.setattr(cudart.torch.version, "cuda", "13.0")
    monkeypatch.setattr(cudart, "_maps", lambda: _maps(CUPY, TORCH))
    opened = []
    monkeypatch.setattr(cudart, "_open", lambda path: opened.append(path) or object())
    return opened


def test_a_runtime_whose_version_disagrees_is_not_bound_and_said_once(fresh, monkeypatch, caplog):
    monkeypatch.setattr(cudart, "_runtime_version", lambda lib: 12080)
    with caplog.at_level(logging.WARNING, logger="layerstream.system.cudart"):
        assert cudart.runtime() is None
        assert cudart.runtime() is None
    assert fresh == [TORCH]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "reports CUDA runtime 12080, torch was built with CUDA 13.0" in said[0]


def test_a_runtime_whose_version_agrees_is_bound(fresh, monkeypatch, caplog):
    """Negative control for the test above: the same choice with the version torch has is bound."""
    bound = []
    monkeypatch.setattr(cudart, "_runtime_version", lambda lib: 13000)
    monkeypatch.setattr(cudart, "Runtime", lambda lib: bound.append(lib) or "runtime")
    with caplog.at_level(logging.WARNING, logger="layerstream.system.cudart"):
        assert cudart.runtime() == "runtime"
    assert fresh == [TORCH] and len(bound) == 1 and not caplog.records
