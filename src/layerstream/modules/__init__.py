"""What is done to the user's modules: the streamed layer, class swapping, slot bindings, writes, NF4."""
