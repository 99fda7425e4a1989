"""What the dashboard measures of the fleet: queues and daemons probed each refresh,
latency from final events, bulk runs from rq, and the history the charts draw."""
