"""Faults Redis really has, injected for real: a TCP proxy and redis-server helpers."""
