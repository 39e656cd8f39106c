import logging
import os

import pytest
import torch
from hypothesis import settings

from memplan.pipeline import pass_failures

pytest_plugins = ["pytester"]

# Plans are priced with the time model's reference rates, not the rates calibrated on the machine that
# runs the suite: the same plans, and so the same peaks, on every machine (see memplan.analysis.cost).
os.environ["MEMPLAN_RATES"] = "reference"

# Under pytest-xdist each worker is a process: torch's intra-op threads are shared out between them (an
# explicit OMP_NUM_THREADS, as .ci/variations sets, is left as it is). Plans do not depend on it: the
# reference rates price one thread.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# The plain test run draws the same examples on every machine and every run, so a failure is the
# change's, and the command that failed reproduces it. `--hypothesis-profile=explore` draws new
# examples on each run: the way to look for bugs that the fixed ones miss.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("repeatable")


@pytest.fixture(autouse=True)
def passes_fail_loudly():
    """A pass that fails raises PassError in memplan's own tests, where users get the plan without it
    and a warning: a broken pass must fail the suite, not hide behind a warning. A test of the rollback
    asks for it (``PassManager(on_failure="rollback")`` or ``with pass_failures("rollback")``)."""
    with pass_failures("raise"):
        yield


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: its compilations start from nothing and leave no
    guards behind (``pytestmark = pytest.mark.usefixtures("fresh_dynamo")`` in a module that compiles)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fake_tensor_log():
    """The records torch's fake tensor module logs during the test (its logger does not propagate to
    the root logger, so ``caplog`` misses them)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
