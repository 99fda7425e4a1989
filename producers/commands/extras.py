"""How to add an extra to batchd, as every message that asks for one says it.

batchd is on no package index, so ``pip install 'batchd[daemon]'`` would ask an index for
a project of that name: none, or somebody else's. An extra is installed from the wheel
batchd was installed from (docs/getting-started.md builds it into ``dist/``), or from the
clone in an editable install.
"""

from __future__ import annotations

from collections.abc import Sequence


def install_command(extras: Sequence[str]) -> str:
    """The command that adds ``extras`` to this installation."""
    names = ",".join(extras)
    wheel = f'pip install "$(ls dist/batchd-*.whl)[{names}]"'
    return f"{wheel} (in a clone: pip install -e '.[{names}]')"
