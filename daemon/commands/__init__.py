"""The daemon-side ``batchd`` subcommands: thin argument parsing over demo, bench and worker."""
