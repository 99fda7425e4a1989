"""``batchd bench --workload gateway``: one gateway process under load (see ``load``).

Apart from the model workloads: it never loads MLX in the bench's process, and it runs
its own redis-server, daemon and gateway as processes (``stack``).
"""
