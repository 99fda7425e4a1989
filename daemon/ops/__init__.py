"""Operations: how a daemon tells its supervisor, its metrics scraper and its logs what it does.

The worker loop calls :class:`batchd.daemon.ops.observer.Ops` at a few points (ready,
job started, after each step, job finished, once per loop turn, stopping); the
rest of this room turns those calls into sd_notify messages, Prometheus series
and log lines. Nothing here changes what the loop does.
"""
