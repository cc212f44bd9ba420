"""Pure decisions, no CUDA: the prefetch schedule, the resident window's size, the disk tier's split."""
