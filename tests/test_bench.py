"""``memplan bench`` and the hand-written baselines it runs beside eager and memplan."""

from __future__ import annotations

import json

import pytest
import torch

import memplan.examples as examples
from memplan.baselines import BASELINES, hand_written
from memplan.bench import interleaved_medians, run_bench
from memplan.cli import main
from memplan.testing import assert_equivalent


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_baselines_match_the_example(name):
    # Same parameters, same outputs and gradients (up to summation order): only memory and time differ.
    w = examples.make(name)
    assert_equivalent(w.model, hand_written(name, w.model), *w.inputs)


def test_unknown_baseline_is_named():
    with pytest.raises(KeyError, match="no hand-written baseline for 'mlp'"):
        hand_written("mlp", None)


def test_bench_runs_eager_memplan_and_the_baseline_side_by_side():
    (row,) = run_bench(["broadcast_matmul"], modes=("train",), repeats=1, passes="rewrite", baselines=True).rows
    assert row.baseline == BASELINES["broadcast_matmul"][0]
    # The report's fix and memplan's rewrite both avoid the expanded copy of the weight.
    assert row.baseline_peak < row.measured / 10 and row.optimized < row.measured / 10
    assert row.baseline_seconds > 0 and row.optimized_seconds > 0 and row.eager_seconds > 0
    assert row.baseline_reduction == row.measured / row.baseline_peak


def test_inference_rows_have_no_baseline():
    (row,) = run_bench(["broadcast_matmul"], modes=("infer",), repeats=1, passes=None, baselines=True).rows
    assert row.baseline_peak is None and row.baseline_seconds is None and row.optimized is None


def test_cli_json(capsys):
    assert main(["bench", "broadcast_matmul", "--mode", "train", "--repeats", "1", "--passes", "rewrite", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["workload"] == "broadcast_matmul" and row["baseline_peak"] < row["measured"]
    assert main(["bench", "broadcast_matmul", "--mode", "train", "--repeats", "1", "--no-baselines", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["baseline_peak"] is None


def test_each_function_is_timed_in_blocks_of_its_own_calls_after_an_untimed_one():
    # A step's time depends on what the step before left (the heap, the caches): each block starts with
    # an untimed call, so every timed call follows a call of the same function, as in a training loop.
    calls = []
    fns = [lambda name=name: calls.append(name) for name in "abc"]
    medians = interleaved_medians(fns, 6, torch.device("cpu"), block=4)
    assert len(medians) == 3
    assert calls == list("aaaaabbbbbccccc" + "aaabbbccc")  # blocks of 4 then 2, each after one untimed call


def test_cli_table_keeps_its_numbers_when_piped(capsys):
    # Printed to a pipe, the table was squeezed to 80 columns: every number became "5…".
    assert main(["bench", "broadcast_matmul", "--mode", "train", "--repeats", "1", "--passes", "rewrite", "--no-baselines"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "broadcast_matmul" in out and "MiB" in out


def test_cli_says_a_capture_error_in_one_line(tmp_path, capsys):
    (tmp_path / "bad.py").write_text(
        "import torch\n"
        "class Bad(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        if x.sum() > 0:\n"
        "            return x * 2\n"
        "        return x\n"
        "def make():\n"
        "    return Bad(), (torch.randn(3),)\n"
    )
    assert main(["analyze", f"{tmp_path / 'bad.py'}:make"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memplan analyze: CaptureError:") and "Traceback" not in err and "bad.py:4" in err
    with pytest.raises(SystemExit, match="no such directory"):
        main(["report", f"{tmp_path / 'bad.py'}:make", "--out", str(tmp_path / "missing" / "r.html")])
