"""LoRA adapters per request: loaded from mlx-lm's (or PEFT's) files, kept resident in a
bounded LRU cache, applied per row inside one packed forward (docs/adapters.md)."""
