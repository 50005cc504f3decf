"""One intra-op thread per test process, and prime_ac's once-per-process reports said afresh
in each test.

The tests run tiny tensors, where a second thread only adds synchronisation; with pytest-xdist
(one worker per core) or another job on the machine, extra threads oversubscribe the cores and a
test takes 2-5x longer. Results do not depend on it: every comparison runs in one process.
"""

import sys

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reports_said_afresh():
    """prime_ac says each report once per process; each test starts as a fresh process would
    (nothing to do where no test imported prime_ac)."""
    watch = sys.modules.get("prime_ac.watch")
    if watch is not None:
        watch._SAID.clear()
    yield
