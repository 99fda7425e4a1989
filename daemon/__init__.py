"""The batchd worker daemon and the ``batchd`` command line.

Nothing here imports MLX at package import time: the CLI also serves
producer-only installs, and loads the engine only for commands that need it.
"""
