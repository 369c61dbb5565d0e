"""Where the suite's files are, for tests and the child processes they start.

`tests/` holds one folder a layer, in the library's data-flow order (api, host, layout,
device, engine, checkpoint, serving, then processes: two real processes, and project:
docs, README, repository rules), and this `support/` folder: the float64 references, the
shared helpers and the scripts child processes run. Test modules import helpers and each
other by bare name (`import process_helpers`, `from test_engine import OPTIMIZER_HP`):
`conftest.py` puts every folder on `sys.path`, and `child_pythonpath()` gives a child the
same path."""

from __future__ import annotations

import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(SUPPORT)
ROOT = os.path.dirname(TESTS)


def import_path() -> list[str]:
    """The support folder, then every layer folder (those holding a `test_*.py`)."""
    layers = sorted(
        os.path.join(TESTS, name)
        for name in os.listdir(TESTS)
        if os.path.isdir(os.path.join(TESTS, name))
        and any(f.startswith("test_") for f in os.listdir(os.path.join(TESTS, name)))
    )
    return [SUPPORT, *layers]


def child_pythonpath(*extra: str) -> str:
    """PYTHONPATH for a child process: the repository (embedmesh), the suite's folders,
    then `extra` (e.g. the caller's own PYTHONPATH)."""
    return os.pathsep.join([ROOT, *import_path(), *filter(None, extra)])
