"""A daemon among others: its heartbeat, claiming dead daemons' jobs, trimming shared queues."""
