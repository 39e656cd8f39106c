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


def test_the_bench_table_reads_at_100_columns():
    # the table took 160 columns: piped into a log, each row wrapped over several lines
    from rich.console import Console

    from memplan.bench import BenchResult, BenchRow

    # the widest figures a run gives: a report's full size on a GPU, a plan thousands of times lower
    rows = [BenchRow(name, mode, "full", "cuda:0", 987 * 2**30 + 12345, 986 * 2**30, 123.45, 0.5, "default",
                     345 * 2**20, 345 * 2**20, 0.61, "the baseline", 456 * 2**20 if mode == "train" else None,
                     0.7 if mode == "train" else None)
            for name in ("chain_product", "broadcast_matmul", "maxsim", "latent_gru", "seq2seq")
            for mode in ("train", "infer")]
    console = Console(width=100, record=True)
    console.print(BenchResult(tuple(rows), "2.13.0+cpu", "NVIDIA H100 80GB HBM3 (cuda:0)"))
    lines = console.export_text().splitlines()
    assert all(len(line.rstrip()) <= 100 for line in lines) and not any("…" in line for line in lines)
    table = [line for line in lines if "MiB" in line or "GiB" in line or "TiB" in line]
    assert len(table) == len(rows) and not any("…" in line for line in table)  # one line a row, nothing cut
    assert "broadcast_matmul" in "\n".join(table) and "2930x" in table[0]
