"""Checkpoints on disk: stored tensors, transformers' conversions, reading, computed buffers, paths, progress."""
