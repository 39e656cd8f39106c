import logging

import pytest
from hypothesis import settings

pytest_plugins = ["pytester"]

# The plain test run draws the same examples on every machine and every run, so a failure is the
# change's, and the command that failed reproduces it. `--hypothesis-profile=explore` draws new
# examples on each run: the way to look for bugs that the fixed ones miss.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("repeatable")


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
