"""One packed forward on MLX: the KV pool, paged attention, the model runner, CPU math."""
