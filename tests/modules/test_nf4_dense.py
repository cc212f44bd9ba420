"""NF4 weights dequantised once for the tiled MLP's tiles, on CUDA: at a training-sized
tile (bitsandbytes dequantises + linear) the kept weight gives the resident model's bits,
where a short last tile goes to bitsandbytes' fused kernel the kept weight stays out, and
a kept weight used at that fused tile is caught."""

import pytest

import layerstream
from layerstream.long import tiled_mlp
from layerstream.modules import nf4, nf4_dense

from tiny import assert_traces_equal, nf4_pair, stream, train_steps

pytestmark = pytest.mark.gpu

# batch 2 x 1600 tokens in tiles of 1598: two of M = 1598 (above bitsandbytes' 1536, so
# dequantise + linear) and a last one of M = 4 (at its floor: the fused kernel)
SEQ, TILE = 1600, 1598


def _pair(tmp_path):
    streamed, resident = nf4_pair(
        tmp_path, "llama", layers=5, device="cuda", attn="eager", max_position_embeddings=4096
    )
    stream(streamed, "cuda", slots=2, prefetch=1, mlp_tile_tokens=TILE)
    tiled_mlp.apply(resident, TILE)
    return streamed, resident


def _train(model, steps=3):
    return train_steps(model, steps, "cuda", seq=SEQ, batch_size=2)


def test_tiles_on_kept_weights_match_resident_bit_for_bit(tmp_path):
    streamed, resident = _pair(tmp_path)
    assert_traces_equal(_train(streamed), _train(resident))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["nf4_dequantisations"] == 3 * 5 * 3 * 2, "each MLP weight once forward, once backward"
    assert stats["nf4_function_calls"] > 0, "the short last tile went to the fused kernel"


def test_a_kept_weight_at_the_fused_tile_is_caught(tmp_path, monkeypatch):
    """Negative control: the short last tile computed on the kept weight (dequantise +
    linear) instead of bitsandbytes' fused kernel changes the results."""
    gate = nf4.fused_kernel_would_run
    monkeypatch.setattr(nf4, "fused_kernel_would_run", lambda *a, **k: False if nf4_dense.active() else gate(*a, **k))
    streamed, resident = _pair(tmp_path)
    with pytest.raises(AssertionError):
        assert_traces_equal(_train(streamed, steps=1), _train(resident, steps=1))
