"""The layerstream command: one module per subcommand."""
