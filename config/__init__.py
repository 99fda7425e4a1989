"""batchd configuration.

- :mod:`batchd.config.limits`: what a producer needs (the default Redis URL, the name
  rule, the job limits); imports nothing of the engine.
- :mod:`batchd.config.settings`: the whole Settings object (the daemon's, the engine's
  options among them) and :func:`~batchd.config.settings.load_settings`.

This package imports neither, so importing one never loads the other.
"""
