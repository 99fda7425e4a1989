"""The producer-side ``batchd`` subcommands, one module per command group (no MLX here)."""
