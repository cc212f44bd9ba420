"""Long sequences: the head and loss in chunks of tokens, the MLP and the norms in tiles, and
TRL's fused log-prob head where it computes the loss instead."""
