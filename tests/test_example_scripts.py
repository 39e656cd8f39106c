"""The scripts in ``examples/``: each runs at its ``--small`` size and prints memplan's peak at or below eager's.

Every ``examples/*.py`` is found by glob, so a new script is tested without editing this file. Each runs as a
reader runs it, ``python examples/NAME.py``, in a subprocess from the repository root with the checkout on
``PYTHONPATH``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the scripts a reader runs; a module whose name starts with "_" is what they share (examples/_compare.py)
SCRIPTS = sorted(path for path in (ROOT / "examples").glob("*.py") if not path.name.startswith("_"))

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
_SIZE = r"(\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB|PiB))"
# The rows of the table each script prints: the peak measured by memplan.measure, then the predicted one.
_EAGER_ROW = re.compile(rf"^\s*eager PyTorch\s+{_SIZE}\s+{_SIZE}", re.MULTILINE)
_MEMPLAN_ROW = re.compile(rf"^\s*memplan\s+{_SIZE}\s+{_SIZE}", re.MULTILINE)


def _bytes(text: str) -> float:
    """Bytes of a size as ``memplan.format_bytes`` prints it, e.g. ``"12.34 MiB"``."""
    number, unit = text.split()
    return float(number) * _UNITS[unit]


def test_one_script_per_user_report_and_a_template() -> None:
    names = {script.name for script in SCRIPTS}
    reports = {name[:3] for name in names}
    assert {"000", "001", "002", "003", "004"} <= reports, sorted(names)
    assert "your_model.py" in names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_script_runs_and_memplan_lowers_the_peak(script: pathlib.Path, tmp_path: pathlib.Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # The --small sizes gain nothing from intra-op threads, and on a busy CPU the threads' waiting on each other
    # costs several times the work; a thread count set outside (.ci/variations runs one and two) is kept.
    env.setdefault("OMP_NUM_THREADS", "1")
    result = subprocess.run(
        [sys.executable, str(script), "--small", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    output = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, f"{script.name} exited with {result.returncode}\n{output}"
    # A pass that breaks must fail here, not hide behind a warning while the script still runs.
    assert "PassRolledBackWarning" not in result.stderr, output
    assert "VerificationWarning" not in result.stderr, output

    eager = _EAGER_ROW.search(result.stdout)
    planned = _MEMPLAN_ROW.search(result.stdout)
    assert eager is not None and planned is not None, f"no peak table in the output\n{output}"
    assert _bytes(planned[1]) <= _bytes(eager[1]), f"memplan's measured peak is above eager's\n{output}"
    assert list(tmp_path.glob("*.html")), f"no HTML report written to --out\n{output}"
