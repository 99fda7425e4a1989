"""What runs each step: sequences, the KV block bookkeeping, the scheduler (pure Python)."""
