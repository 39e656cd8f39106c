"""Tests of ``benchmarks/cuda_check.py``, the one command a lent GPU runs, exercised on the CPU.

A GPU is lent for minutes, so the check must work the first time it meets one. Its dry run (``--device cpu``)
runs the same stages, worker and files on the CPU: these tests run it whole, cut it short (no time left,
SIGTERM) and check that valid files are left each time, and test the parts a CPU run reaches only by accident:
the kill of a stuck worker, the pytest stage's deadline, and the judging of figures a GPU would give.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import memplan.examples as examples

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "cuda_check.py"
MiB = 2**20


def _benchmark(name: str) -> Any:
    """A script of ``benchmarks/`` (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"memplan_benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


cuda_check = _benchmark("cuda_check")


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--device", "cpu", "--size", "small", "--out", str(out), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _record(out: Path) -> dict[str, Any]:
    return json.loads((out / "cuda_check.json").read_text())


# ----------------------------------------------------------------------------------------------
# The dry run, whole and cut short
# ----------------------------------------------------------------------------------------------


def test_the_dry_run_writes_every_workload_with_its_figures(tmp_path):
    # The smallest settings: one timed step, a 2 s compile limit (some compile, the rest show the limit), and
    # 20 MiB "free", under which the chain product (54 MiB) and the broadcast matmul (65 MiB) must not run eagerly.
    done = subprocess.run(
        _command(tmp_path, "--no-pytest", "--repeats", "1", "--compile-limit", "2", "--free-memory", "20MiB"),
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = _record(tmp_path)
    assert record["status"] == "finished" and record["exit_code"] == 0 and record["failures"] == []
    assert record["device"]["type"] == "cpu" and record["device"]["torch"] == torch.__version__
    assert record["settings"]["activation_memory_budget"] == 0.5
    assert [w["name"] for w in record["workloads"]] == list(examples.WORKLOADS)
    for w in record["workloads"]:
        assert w["status"] == "ok" and w["verify"] == "match", w
        assert w["eager_fits"] == (w["predicted"] * (1 + 0.10) <= 20 * MiB), w
        assert 0 < w["memplan_peak"] < w["predicted"], w
        assert abs(w["derived"]["memplan_prediction_ratio"] - 1) <= 0.05, w
        assert w["plan_seconds"] > 0 and w["memplan_seconds"] > 0
        if w["eager_fits"]:
            assert abs(w["derived"]["eager_prediction_ratio"] - 1) <= 0.05, w
            assert w["derived"]["reduction"] > 1 and w["derived"]["time_ratio"] > 0
        else:
            assert w.get("eager_peak") is None and w["eager_note"].startswith("does not fit (predicted"), w
        compiled = w["compile"]
        assert compiled["status"] in ("ok", "skipped"), compiled
        if compiled["status"] == "ok":
            assert compiled["peak"] > 0 and compiled["compile_seconds"] > 0
        else:
            assert compiled["note"], compiled
    assert {w["name"] for w in record["workloads"] if not w["eager_fits"]} == {"chain_product", "broadcast_matmul"}
    markdown = (tmp_path / "cuda_check.md").read_text()
    assert markdown.startswith("### CUDA check, dry run on CPU")
    for name in examples.WORKLOADS:
        assert f"\n| {name} | " in markdown
    assert "| does not fit (predicted 54.26 MiB) |" in markdown
    # the offload stage: every plan checked against eager, predicted exactly on the emulated host tier
    offload = record["offload"]
    assert offload["status"] == "ok" and offload["failures"] == [], offload
    assert offload["offload_moved"] >= 1 and offload["offload_peak"] < offload["kept_peak"], offload
    for label in ("kept", "offload"):
        assert offload[f"{label}_verify"] == "match" and offload[f"{label}_peak"] == offload[f"{label}_planned"]
    assert "Offload stage (deep_mlp, `small` size)" in markdown and "\n| offload | " in markdown


def test_a_run_with_no_time_left_skips_every_stage_and_still_writes_valid_files(tmp_path):
    done = subprocess.run(_command(tmp_path, "--budget-seconds", "1"), cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr  # nothing failed, but nothing was shown either
    record = _record(tmp_path)
    assert record["status"] == "finished" and record["exit_code"] == 3
    assert record["pytest"]["status"] == "skipped" and "out of time" in record["pytest"]["note"]
    for w in record["workloads"]:
        assert w["status"] == "skipped" and "out of time" in w["note"]
        assert w["compile"]["status"] == "skipped" and "out of time" in w["compile"]["note"]
    assert record["offload"]["status"] == "skipped" and "out of time" in record["offload"]["note"]
    markdown = (tmp_path / "cuda_check.md").read_text()
    assert all(f"\n| {name} | " in markdown for name in examples.WORKLOADS)


def test_sigterm_writes_what_was_measured_and_ends_the_worker(tmp_path):
    process = subprocess.Popen(_command(tmp_path, "--no-pytest"), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        worker = None
        while worker is None and time.monotonic() < deadline:  # until the worker has greeted
            time.sleep(0.2)
            if (tmp_path / "cuda_check.json").exists():
                worker = _record(tmp_path)["device"].get("pid")
        assert worker is not None, "the worker never greeted"
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output
    record = _record(tmp_path)
    assert record["status"] == "interrupted by SIGTERM" and record["finished"] is not None
    assert {w["status"] for w in record["workloads"]} <= {"ok", "interrupted", "skipped"}
    assert "interrupted by SIGTERM" in (tmp_path / "cuda_check.md").read_text()
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


# ----------------------------------------------------------------------------------------------
# The parts a GPU run needs that a dry run does not reach
# ----------------------------------------------------------------------------------------------


def test_the_two_halves_agree_on_the_protocol_prefix():
    assert cuda_check.PREFIX == _benchmark("cuda_check_worker").PREFIX


_STUCK_WORKER = textwrap.dedent(
    """
    import json, sys, time
    print("@cuda_check " + json.dumps({"hello": {"device_name": "stand-in"}}), flush=True)
    print("a line of a library's, for the log", flush=True)
    for line in sys.stdin:
        task = json.loads(line)
        print("@cuda_check " + json.dumps({"id": task["id"], "update": {"phase": "compiling"}}), flush=True)
        if task["workload"] == "exit":
            sys.exit(3)
        time.sleep(600)  # stuck below Python, as a hung CUDA call would be
    """
)


def test_a_worker_stuck_past_its_limit_is_killed_and_one_that_exits_is_reported(tmp_path):
    log = tmp_path / "worker.log"
    worker = cuda_check.Worker([sys.executable, "-c", _STUCK_WORKER], log, grace=0.5)
    assert worker.start(60, lambda: None) == {"device_name": "stand-in"}
    updates = []
    start = time.monotonic()
    assert worker.run({"id": 1, "workload": "stuck"}, 0.2, lambda: None, updates.append) == "killed"
    assert time.monotonic() - start < 10 and not worker.alive()
    assert updates == [{"phase": "compiling"}]
    worker.start(60, lambda: None)
    assert worker.run({"id": 2, "workload": "exit"}, 30, lambda: None, updates.append) == "died"
    assert "a line of a library's, for the log" in log.read_text()
    worker.stop()


def test_a_worker_that_cannot_start_is_one_clear_error(tmp_path):
    log = tmp_path / "worker.log"
    worker = cuda_check.Worker([sys.executable, "-c", "raise ImportError('no module named memplan')"], log)
    with pytest.raises(cuda_check.SetupError, match="exited with code 1: ImportError: no module named memplan"):
        worker.start(60, lambda: None)


def _pytest_stage(tmp_path: Path, body: str, limit: str) -> dict[str, Any]:
    (tmp_path / "test_stand_in.py").write_text(body)
    args = cuda_check._parse(["--out", str(tmp_path), "--device", "cpu", "--pytest-limit", limit,
                              "--pytest-args", f"-q -p no:cacheprovider {tmp_path / 'test_stand_in.py'}"])
    run = cuda_check.Run(args, [])
    run.out.mkdir(exist_ok=True)
    stage = cuda_check.PytestStage(run, args)
    stage.start()
    stage.wait()
    return run.record["pytest"]


def test_the_pytest_stage_records_pytests_summary(tmp_path):
    state = _pytest_stage(tmp_path, "def test_one():\n    pass\n", "120")
    assert state["status"] == "passed" and state["returncode"] == 0
    assert state["summary"].startswith("1 passed")


def test_the_pytest_stage_is_killed_at_its_limit(tmp_path):
    state = _pytest_stage(tmp_path, "import time\n\ndef test_slow():\n    time.sleep(600)\n", "1")
    assert state["status"] == "failed" and state["note"].startswith("timed out after")
    assert state["seconds"] < 30


def _workload(**figures: Any) -> dict[str, Any]:
    base = {"name": "maxsim", "status": "ok", "predicted": 100 * MiB, "eager_fits": True, "free": 70 * 2**30,
            "eager_peak": 100 * MiB, "planned": 10 * MiB, "memplan_peak": 10 * MiB, "verify": "match",
            "eager_seconds": 0.010, "memplan_seconds": 0.012, "compile": {"status": "pending"}}
    return {**base, **figures}


def test_the_judge_names_each_check_that_does_not_hold():
    assert cuda_check.judge(_workload()) == []
    assert cuda_check.judge(_workload(eager_peak=104 * MiB, memplan_peak=10.4 * MiB)) == []  # within 5%
    assert cuda_check.judge(_workload(eager_peak=None, eager_fits=False)) == []  # did not fit: not run
    (failure,) = cuda_check.judge(_workload(memplan_peak=11 * MiB))
    assert failure == "memplan's peak 11.00 MiB is 10.0% above the plan's prediction 10.00 MiB"
    (failure,) = cuda_check.judge(_workload(planned=120 * MiB, memplan_peak=120 * MiB))
    assert failure == "memplan's peak 120.00 MiB is above eager's 100.00 MiB"
    (failure,) = cuda_check.judge(_workload(verify="rolled back", verify_note="memplan rolled back pass 'chunk'"))
    assert failure == "verify=True rolled back: memplan rolled back pass 'chunk'"
    (failure,) = cuda_check.judge(_workload(eager_peak=None, eager_note="out of memory: CUDA out of memory"))
    assert failure.startswith("eager ran out of memory although its predicted peak 100.00 MiB fitted")
    (failure,) = cuda_check.judge(_workload(memplan_peak=None, planned=None, memplan_note="out of memory: ..."))
    assert failure == "memplan did not run: out of memory: ..."


def test_the_offload_judge_names_each_check_that_does_not_hold():
    fine = {"eager_peak": 100 * MiB, "kept_planned": 60 * MiB, "kept_peak": 60 * MiB, "kept_verify": "match",
            "offload_planned": 40 * MiB, "offload_peak": 41 * MiB, "offload_verify": "match"}
    assert cuda_check.judge_offload(fine) == []
    (failure,) = cuda_check.judge_offload({**fine, "offload_peak": 44 * MiB})
    assert failure == "offload: peak 44.00 MiB is 10.0% above the plan's 40.00 MiB"
    (failure,) = cuda_check.judge_offload({**fine, "kept_verify": "differs", "kept_verify_note": "grad of w"})
    assert failure == "kept: verify=True differs: grad of w"
    (failure,) = cuda_check.judge_offload({**fine, "error": "TaskTimeout: passed its 90 s limit", "phase": "timing"})
    assert failure == "raised TaskTimeout: passed its 90 s limit (during timing)"


def test_the_markdown_names_the_device_and_says_what_did_not_run(tmp_path):
    args = cuda_check._parse(["--out", str(tmp_path)])
    run = cuda_check.Run(args, ["--out", "DIR"])
    record = run.record
    record["device"].update(name="NVIDIA H100 80GB HBM3", torch="2.11.0+cu130", cuda="13.0")
    record["workloads"] = [
        _workload(name="maxsim", compile={"status": "ok", "peak": 50 * MiB, "seconds": 0.006, "eager_seconds": 0.010,
                                          "compile_seconds": 31.5},
                  inductor_backend_peak=8 * MiB, inductor_backend_seconds=0.004, inductor_backend_eager_seconds=0.010,
                  inductor_backend_first_call_seconds=12.25),
        _workload(name="chain_product", eager_peak=None, eager_fits=False, predicted=3 * 2**40,
                  eager_note="does not fit (predicted 3.00 TiB, 70.00 GiB free)", eager_seconds=None,
                  compile={"status": "skipped", "note": "did not compile within 60 s"}),
    ]
    markdown = cuda_check.render_markdown(record)
    assert markdown.startswith("### CUDA check on NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, CUDA 13.0), `full` sizes")
    assert ("| maxsim | 100.00 MiB | 100.00 MiB | 1.000 | 10.00 MiB | 10.00 MiB | 1.000 | 10.00x | 10.0 ms | 1.20x "
            "| 50.00 MiB | 0.60x | ok |") in markdown
    assert "memplan.compile.backend(inductor=True): peak 8.00 MiB, step time 0.40x eager's, first call 12.2 s" in markdown
    assert "| chain_product | does not fit (predicted 3.00 TiB) | 3.00 TiB | - |" in markdown
    assert ("- chain_product: verify: match; eager does not fit (predicted 3.00 TiB, 70.00 GiB free); torch.compile "
            "skipped: did not compile within 60 s.") in markdown
