"""The hand-run measurements still run: they import, parse their options (the gateway's
--model included) and the grammar timing measures on a model."""

from __future__ import annotations

from pathlib import Path

import pytest

from measure import constrained, gateway, sentinel


def test_the_gateway_measure_serves_any_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        gateway.main(["--help"])
    assert done.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_the_grammar_masks_are_timed_on_a_model(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert constrained.mask_time(tiny_model, walks=2) == 0
    assert "mask per step" in capsys.readouterr().out


def test_the_sentinel_measure_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert sentinel.main(["--submits", "5", "--connects", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "sentinel submit, replicas=1: median" in out and "replica promoted" in out
