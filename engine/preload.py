"""Import this before ``mlx``: on Linux it loads OpenBLAS so MLX's CPU products use it.

The engine's modules that import MLX (and the daemon's) import this module first, in an
import section of its own that sorts before third-party imports (``pyproject.toml``,
ruff's isort sections), so the order cannot be lost to a reformat. It is a module, not
the package's ``__init__``, so that importing the engine's pure-Python parts (its
options, the scheduler) loads no BLAS and changes no environment variable: a producer
that reads the settings stays free of both (see :mod:`batchd.engine.blas`).

It also turns transformers' import-time notices into batchd DEBUG lines (see
:func:`demote_import_notices`), since mlx-lm, which the engine loads models with,
imports transformers.
"""

from __future__ import annotations

import logging

from batchd.engine.blas import preload_openblas

log = logging.getLogger("batchd.engine.thirdparty")

# Notices transformers logs (as warnings) when it is imported without PyTorch, which
# batchd never needs: mlx-lm uses only its tokenizers and configuration.
IMPORT_NOTICES = (
    "PyTorch was not found.",  # transformers 5 (seen with 5.24)
    "None of PyTorch, TensorFlow >= 2.0, or Flax have been found.",  # transformers 4
)


class ImportNoticeFilter(logging.Filter):
    """Drops transformers' no-PyTorch notice, logging it at DEBUG on batchd's logger.

    transformers writes its records with a stderr handler of its own (plain text, not
    propagated), so the notice would land among JSON log lines and read as fatal.
    Every other record of that logger passes unchanged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(IMPORT_NOTICES):
            return True
        log.debug("%s: %s", record.name, message, extra={"event": "third_party_notice"})
        return False


def demote_import_notices() -> None:
    """Install the filter on the ``transformers`` logger (idempotent; imports nothing).

    A logger's filters see the records logged on that logger itself, which is where
    transformers' ``__init__`` logs the notice; its submodules' warnings are untouched.
    """
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, ImportNoticeFilter) for f in logger.filters):
        logger.addFilter(ImportNoticeFilter())


preload_openblas()
demote_import_notices()
