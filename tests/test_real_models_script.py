"""``benchmarks/real_models.py`` at ``--size small``: every variant in the table, the three checks computed.

Their outcomes are the benchmark's business, not this test's; it checks that the script runs end to end, that
the model gets a row per variant and that each check has a verdict. torch.compile's row (a process of its own
that imports the libraries again and compiles: half a minute) is left to the benchmark's runs, to keep CI short.
"""

import importlib.util
import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _benchmark(name: str):
    """A script of ``benchmarks/`` (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"memplan_benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_small_run_has_every_variant_and_each_check(tmp_path, capsys):
    pytest.importorskip("transformers")
    real_models = _benchmark("real_models")
    out = tmp_path / "real_models.json"
    result = real_models.main(["--size", "small", "--models", "gpt2", "--repeats", "1", "--budgets",
                               "--no-compile", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    # no fractional budget: one more plan of the ladder, which tests/test_pipeline.py covers
    variants = ["eager", "checkpoint per block", "memplan default", "memplan smallest"]
    printed = capsys.readouterr().out
    for model in ("gpt2",):
        rows = [r for r in result["rows"] if r["model"] == model]
        assert [r["variant"] for r in rows] == variants
        assert all(r["peak"] is not None or r["note"] for r in rows), rows  # a figure, or why not
        assert all(r["grads"] for r in rows if r["memplan"] and r["peak"] is not None)
        verdicts = [c for c in result["checks"] if c["model"] == model]
        assert [c["name"] for c in verdicts] == ["a", "b", "c"]
        assert all(c["passed"] in (True, False) for c in verdicts), verdicts
        assert all(f"{model} ({c['name']}) {'PASS' if c['passed'] else 'FAIL'}" in printed for c in verdicts)
    assert all(f"| {v}" in printed for v in variants)
