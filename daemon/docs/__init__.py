"""The generated reference pages of the documentation site (docs/reference/).

Each page is rendered from the code it documents, so that it cannot drift from it:
the command line from :func:`batchd.daemon.cli.build_parser`, the configuration from
:class:`batchd.config.settings.Settings` (its models' attribute docstrings) and the
documented default file ``config/batchd.toml``, the wire protocol from the JSON Schema
``producers/protocol.schema.json``. ``python -m batchd.daemon.docs`` writes them;
``--check`` says which committed page differs (tests/docs runs it).
"""
