"""The OpenAI-compatible gateway: HTTP in, batchd jobs out, events streams back.

It lives on the producers side (no MLX), so it runs anywhere a client runs:
``batchd gateway`` serves ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ``/health`` and the Batch API (``/v1/files``, ``/v1/batches``)
in front of a fleet of daemons behind one Redis. See :mod:`batchd.producers.gateway.app`.
"""
