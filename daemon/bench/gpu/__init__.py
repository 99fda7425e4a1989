"""Measurements that need a GPU: run by config/gpu/run_checks.sh on a lent machine."""
