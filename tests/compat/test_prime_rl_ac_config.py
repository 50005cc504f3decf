"""Every ``[trainer.model.ac]`` table prime-rl's configs and examples write loads with the
meaning prime-rl's newest class gives it (or raises, saying why), and docs/migration.md's key
table covers those tables and prime-rl's newest keys (tests/compat/prime_rl_ac_tables.py)."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

from prime_ac import ACConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prime_rl_ac_tables import NEWEST_KEYS, NEWEST_MODES, TABLES  # noqa: E402

MIGRATION = Path(__file__).resolve().parents[2] / "docs" / "migration.md"


def _key_rows() -> dict[str, str]:
    """migration.md's key table: ``{key: the row's prime_ac column}`` for its single-key rows."""
    text = MIGRATION.read_text()
    section = text[text.index("### The `[trainer.model.ac]` keys") :]
    section = section[: section.index("\n\n", section.index("| key |"))]
    rows = {}
    for line in section.splitlines():
        match = re.fullmatch(r"\| `(\w+)` \| (.*) \|", line)
        if match:
            rows[match[1]] = match[2]
    return rows


@pytest.mark.parametrize("entry", TABLES, ids=lambda entry: repr(entry["table"]))
def test_each_prime_rl_table_loads_with_prime_rls_meaning(entry, caplog):
    caplog.set_level(logging.INFO, logger="prime_ac")
    expect = entry["expect"]
    if isinstance(expect, str):
        with pytest.raises(ValueError, match=expect):
            ACConfig.from_dict(entry["table"])
        return
    config = ACConfig.from_dict(entry["table"])
    assert {key: getattr(config, key) for key in expect} == expect
    dropped = [key for key in ("targets", "freq") if key in entry["table"]]
    dropped = [key for key in dropped if getattr(config, key) != entry["table"][key]]
    for key in dropped:  # what prime-rl ignores is dropped with a log line naming it
        assert f"{key}=" in caplog.text and "prime-rl ignores" in caplog.text


def test_the_key_table_covers_every_key_prime_rl_writes_or_declares():
    rows = _key_rows()
    written = {key for entry in TABLES for key in entry["table"]}
    assert set(NEWEST_KEYS) | written <= set(rows), sorted(set(NEWEST_KEYS) | written - set(rows))
    for mode in NEWEST_MODES:
        assert f"`{mode}`" in rows["mode"]
    # a key prime-rl's newest class refuses is not called prime-rl's
    for key in set(rows) - set(NEWEST_KEYS):
        assert "not prime-rl's" in rows[key], (key, rows[key])
    assert "ignores" in rows["freq"] and "ignores" in rows["targets"]


def test_freq_beside_layer_modes_still_raises_where_prime_ac_is_called_directly():
    # the table is read with prime-rl's meaning; prime_ac's own constructor names the conflict
    with pytest.raises(ValueError, match="layer_modes replaces mode and freq"):
        ACConfig(layer_modes=("full", "none"), freq=2)
