"""Shared set-up of the conformance suite: quiet libraries, a frozen heap, a table of held bytes.

The suite's test modules skip themselves when ``transformers`` or ``diffusers`` is missing
(install the ``conformance`` extra).
"""

from __future__ import annotations

import gc

import pytest
from real_models import HELD_RATIOS

try:
    import diffusers
    import transformers
except ImportError:
    pass
else:
    transformers.logging.set_verbosity_error()  # config warnings about tiny vocabularies
    diffusers.logging.set_verbosity_error()


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap():
    """prime_ac.audit runs gc.collect() per measured step, which after the transformers and
    diffusers imports walks about a million long-lived objects; frozen while this suite runs,
    they are skipped (~10x cheaper). tests/conftest.py already keeps torch to one thread."""
    gc.freeze()
    yield
    gc.unfreeze()


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
