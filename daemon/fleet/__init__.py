"""A daemon among others: its heartbeat, the operator's controls (pause, drain), claiming
dead daemons' jobs, trimming shared queues."""
