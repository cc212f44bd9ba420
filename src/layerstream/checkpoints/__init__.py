"""Checkpoints on disk: stored tensors, transformers' conversions and MXFP4 dequantisation, reading, computed buffers, paths, progress."""
