"""One intra-op thread per test process.

The tests run tiny tensors, where a second thread only adds synchronisation; with pytest-xdist
(one worker per core) or another job on the machine, extra threads oversubscribe the cores and a
test takes 2-5x longer. Results do not depend on it: every comparison runs in one process.
"""

import torch

torch.set_num_threads(1)


import pytest  # noqa: E402

import prime_ac.watch  # noqa: E402


@pytest.fixture(autouse=True)
def _reports_said_afresh():
    """prime_ac says each report once per process; each test starts as a fresh process would."""
    prime_ac.watch._SAID.clear()
    yield
