"""Long sequences: the loss in chunks, the MLP and norms in tiles, activations offloaded.

The head and loss in chunks of tokens, the MLP and the norms in tiles, TRL's fused log-prob
head where it computes the loss instead, and each layer's checkpointed input kept in host
memory between its forward and its recompute."""
