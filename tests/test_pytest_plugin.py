"""The pytest plugin catches a planted peak regression, and --memplan-update records baselines."""

import json

PLANTED = """
import torch

SIZE = {size}

def test_model_peak(memplan_baseline):
    memplan_baseline.check("step", lambda: torch.ones(SIZE).exp())

def test_limit(memplan_peak):
    memplan_peak(lambda: torch.ones(SIZE).exp(), max_bytes=2 * 4 * 1024)
"""


def test_update_records_then_a_planted_regression_fails_with_a_diff(pytester):
    pytester.makeini("[pytest]\nmemplan_baseline = peaks.json\n")
    pytester.makepyfile(test_planted=PLANTED.format(size=1024))
    # no baseline yet: the check asks for one
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*no memplan baseline for*--memplan-update*"])
    # record it
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--memplan-update")
    result.assert_outcomes(passed=2)
    recorded = json.loads((pytester.path / "peaks.json").read_text())
    assert recorded == {"test_planted.py::test_model_peak::step": 2 * 4 * 1024}
    result.stdout.fnmatch_lines(["*memplan peak baseline*", "*updated: test_planted.py::test_model_peak::step*"])
    # unchanged code passes
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)
    # plant a regression: the same step on a 50% larger tensor
    pytester.makepyfile(test_planted=PLANTED.format(size=1536))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*memplan peak regression in test_planted.py::test_model_peak::step:*",
            "*baseline*8.00 KiB*",
            "*measured*12.00 KiB*",
            "*+50.0%; tolerance 5%*",
            "*peak * exceeds the limit 8.00 KiB by 4.00 KiB*",
        ]
    )


def test_improvements_are_reported(pytester):
    pytester.makeini("[pytest]\nmemplan_baseline = peaks.json\n")
    (pytester.path / "peaks.json").write_text(json.dumps({"test_planted.py::test_model_peak::step": 100_000}))
    pytester.makepyfile(test_planted=PLANTED.format(size=1024))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-k", "model_peak")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*improved beyond the tolerance*"])
