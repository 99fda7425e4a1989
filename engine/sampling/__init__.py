"""Sampling a step's logits: on the device as MLX ops, or on the host with NumPy."""
