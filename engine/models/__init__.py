"""Getting weights into MLX: loading mlx-lm models, fixture models, CPU weight layout."""
