"""Measurements run by hand (``cd tests && python -m measure.NAME``), not by pytest:
what the README's figures come from, outside the product."""
