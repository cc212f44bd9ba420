"""Where frozen bytes live: the host store, the node-shared store, the disk tier, the GPU slots."""
