"""The README's main command: ``python -m prime_ac demo``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prime_ac.demo import compare_modes


@pytest.mark.slow
def test_demo_cli_prints_a_table_per_model_with_exact_gradients():
    out = subprocess.run(
        [sys.executable, "-m", "prime_ac", "demo", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    assert set(report) == {"dense", "moe"}
    for rows in report.values():
        by_mode = {row["mode"]: row for row in rows}
        assert list(by_mode) == ["none", "full", "selective"]
        assert all(row["max_grad_diff"] == 0.0 for row in rows)
        none, full, selective = by_mode["none"], by_mode["full"], by_mode["selective"]
        assert none["recomputed_ops"] == 0 and none["recomputed_flops"] == 0
        assert full["held_bytes"] < selective["held_bytes"] < none["held_bytes"]
        assert full["held_ratio"] <= 0.15
        assert full["recomputed_flops"] > 0
        assert selective["recomputed_flops"] == 0  # every matmul and attention is kept
        assert full["recomputed_ops"] > selective["recomputed_ops"] > 0


def test_compare_modes_small_model_counts_replayed_forward_flops():
    rows = {r.mode: r for r in compare_modes("dense", batch=1, seq_len=8, n_layers=2)}
    # Full mode replays the block's linears on 8 tokens in 2 blocks: wq, wo (64x64), wk, wv
    # (64x32), w1, w3 (64x128); w2 is not replayed because non-reentrant checkpoint stops the
    # recompute once every tensor the backward needs exists, and nothing needs w2's output.
    # Attention (4 heads of 16 on 8 tokens) is replayed too: QK^T and PV, 2 FLOPs per MAC.
    replayed_macs = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 2
    attention_flops = 2 * (2 * 4 * 8 * 8 * 16)
    assert rows["full"].recomputed_flops == 2 * (2 * 8 * replayed_macs + attention_flops)
    assert rows["selective"].recomputed_flops == 0
