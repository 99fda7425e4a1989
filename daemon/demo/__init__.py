"""``batchd demo``: a daemon, producers and live token streams in one process."""
