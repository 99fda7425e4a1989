"""The import walls between rooms, read from every module's source (lazy imports included).

Imports run one way: commands -> demo/bench -> worker/fleet -> engine/producers/config.
The engine never sees Redis or our other packages; producers never see MLX.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room (a package path) -> import prefixes it must never use
WALLS: dict[str, tuple[str, ...]] = {
    "engine": ("redis", "rq", "batchd.producers", "batchd.daemon", "batchd.config"),
    "producers": ("mlx", "mlx_lm", "numpy", "batchd.engine", "batchd.daemon"),
    # config reads the engine's options from batchd.engine.config (pure Python), nothing else
    "config": (
        "mlx",
        "mlx_lm",
        "numpy",
        "batchd.engine.forward",
        "batchd.engine.models",
        "batchd.engine.constraints",
        "batchd.engine.llm_engine",
        "batchd.engine.preload",
        "batchd.engine.blas",
        "batchd.daemon",
        "batchd.producers",
    ),
    "daemon/worker": (
        "batchd.daemon.commands",
        "batchd.daemon.demo",
        "batchd.daemon.bench",
        "batchd.daemon.cli",
    ),
    "daemon/fleet": (
        "batchd.daemon.commands",
        "batchd.daemon.demo",
        "batchd.daemon.bench",
        "batchd.daemon.cli",
        "mlx",
    ),
    # ops turns the loop's hooks into sd_notify, metrics and logs: it never touches MLX
    "daemon/ops": (
        "batchd.daemon.commands",
        "batchd.daemon.demo",
        "batchd.daemon.bench",
        "batchd.daemon.cli",
        "mlx",
    ),
    "daemon/demo": ("batchd.daemon.commands", "batchd.daemon.bench", "batchd.daemon.cli"),
    "daemon/bench": ("batchd.daemon.commands", "batchd.daemon.demo", "batchd.daemon.cli"),
    # chaos drives daemons as processes, through the producers' surfaces, never their insides
    "daemon/chaos": (
        "batchd.daemon.commands",
        "batchd.daemon.demo",
        "batchd.daemon.bench",
        "batchd.daemon.cli",
        "batchd.daemon.worker",
    ),
}


def imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def crosses(name: str, banned: str) -> bool:
    return name == banned or name.startswith(banned + ".")


@pytest.mark.parametrize("room", sorted(WALLS))
def test_room_respects_its_walls(room: str) -> None:
    modules = sorted((ROOT / room).rglob("*.py"))
    assert modules, f"room {room} has no modules"
    broken = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in modules
        for name in sorted(imported_names(path))
        if any(crosses(name, banned) for banned in WALLS[room])
    ]
    assert not broken, "\n".join(broken)


def test_walls_catch_a_crossing(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from batchd.daemon.commands import serve\n")
    assert any(crosses(n, "batchd.daemon.commands") for n in imported_names(module))


def test_no_room_is_crowded() -> None:
    """A folder of more than ~15 modules holds more than one idea."""
    crowded = {
        str(folder.relative_to(ROOT)): count
        for top in ("engine", "daemon", "producers", "config")
        for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]
        if (count := len([f for f in folder.glob("*.py") if f.name != "__init__.py"])) > 16
    }
    assert not crowded, crowded
