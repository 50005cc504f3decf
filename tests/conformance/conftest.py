"""Shared set-up of the conformance suite: quiet libraries, cheap garbage collection, a ratio table.

The suite's test modules skip themselves when ``transformers`` or ``diffusers`` is missing
(install the ``conformance`` extra).
"""

from __future__ import annotations

import gc

import pytest
import torch
from real_models import HELD_RATIOS

try:
    import diffusers
    import transformers
except ImportError:
    pass
else:
    transformers.logging.set_verbosity_error()  # config warnings about tiny vocabularies
    diffusers.logging.set_verbosity_error()
    # prime_ac.audit runs gc.collect() per measured step; after these imports a collection walks
    # about a million long-lived objects. Freezing them makes each collection ~10x cheaper.
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes gain nothing from intra-op threads; on a busy 2-core machine the threads'
    spin-waits cost ~100x the work itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_ratios: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == HELD_RATIOS and report.when == "call":
            _ratios[value["model"]] = value


def pytest_terminal_summary(terminalreporter):
    """Held bytes under each mode, as a fraction of no AC (prime_ac.audit), one row per model."""
    if not _ratios:
        return
    modes = [key for key in next(iter(_ratios.values())) if key != "model"]
    terminalreporter.section("prime_ac held bytes / no AC (conformance models)")
    terminalreporter.write_line(f"{'model':<16}" + "".join(f"{m:>12}" for m in modes))
    for model, row in sorted(_ratios.items()):
        terminalreporter.write_line(f"{model:<16}" + "".join(f"{row[m]:>12.3f}" for m in modes))
