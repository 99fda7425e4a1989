"""batchd producers: the wire protocol, the client SDK, the CLI and rq bulk queues.

Never imports MLX: a service that only enqueues jobs installs the base
distribution.
"""
