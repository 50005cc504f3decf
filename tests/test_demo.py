"""The README's demo (``python -m prime_ac demo``) and the command line's help and errors.

In-process, on the smallest models that show each property; only deterministic quantities
(bytes, operator counts, FLOPs, gradients) are asserted, never a time.
"""

from __future__ import annotations

import json

import pytest
import torch

import prime_ac.demo
from prime_ac.__main__ import _parsers, main
from prime_ac.demo import compare_modes


@pytest.fixture(scope="module")
def small_results():
    """compare_modes on 2-block models and 8 tokens: every property the demo shows, in seconds."""
    return {
        kind: compare_modes(kind, batch=1, seq_len=8, n_layers=2, repeats=2)
        for kind in ("dense", "moe")
    }


@pytest.fixture
def demo_cli(monkeypatch, capsys, small_results):
    """Run ``python -m prime_ac demo ARGS`` in-process on the small models; return stdout. The
    calls of compare_modes are recorded in ``run.calls``."""
    calls = []

    def small(kind, repeats, **sizes):
        calls.append((kind, repeats, sizes))
        return small_results[kind]

    monkeypatch.setattr(prime_ac.demo, "compare_modes", small)

    def run(*args):
        calls.clear()
        assert main(["demo", *args]) == 0
        return capsys.readouterr().out

    run.calls = calls
    return run


def test_demo_runs_llama_sized_blocks_by_default_and_the_tiny_models_with_tiny(demo_cli):
    out = demo_cli()
    assert demo_cli.calls == [(kind, 5, prime_ac.demo.SIZES[kind]) for kind in ("dense", "moe")]
    assert all(
        sizes["dim"] == 512 and sizes["seq_len"] == 512 for sizes in prime_ac.demo.SIZES.values()
    )
    assert "a step's time is in its FLOPs" in out
    out = demo_cli("--tiny", "--model", "moe", "--repeats", "2")
    assert demo_cli.calls == [("moe", 2, prime_ac.demo.TINY_SIZES["moe"])]
    assert "On models this small (--tiny)" in out


def test_demo_cli_prints_a_table_per_model_with_exact_gradients(demo_cli):
    report = json.loads(demo_cli("--json"))
    assert set(report) == {"dense", "moe"}
    for rows in report.values():
        by_mode = {row["mode"]: row for row in rows}
        assert list(by_mode) == ["none", "plain", "full", "selective"]
        assert all(row["max_grad_diff"] == 0.0 for row in rows)
        none, plain, full, selective = (by_mode[m] for m in ("none", "plain", "full", "selective"))
        assert none["recomputed_ops"] == 0 and none["recomputed_flops"] == 0
        assert full["held_bytes"] < selective["held_bytes"] < none["held_bytes"]
        # full keeps only the mandatory operators (routing, telemetry), none of which has FLOPs:
        # it replays every FLOP plain checkpointing replays, and holds at least as much.
        assert full["recomputed_flops"] == plain["recomputed_flops"] > 0
        assert plain["held_bytes"] <= full["held_bytes"]
        assert selective["recomputed_flops"] == 0  # every matmul and attention is kept
        assert full["recomputed_ops"] > selective["recomputed_ops"] > 0
        assert all(row["step_ratio_low"] <= row["step_ratio_high"] for row in rows)
        assert none["step_ratio"] == 1.0 and plain["step_ratio_plain"] == 1.0


def test_demo_table_puts_counts_first_and_says_which_ops_carry_flops(demo_cli):
    out = demo_cli("--model", "dense", "--repeats", "2")
    header = next(line for line in out.splitlines() if line.startswith("mode"))
    columns = ["held for backward", "recomputed ops", "recomputed FLOPs", "max |grad diff|"]
    positions = [header.index(c) for c in [*columns, "step time (median of 2)", "vs plain"]]
    assert positions == sorted(positions)
    assert "FLOPs count matrix products and attention only" in out


def test_demo_ends_with_a_summary_of_the_modes_and_the_load_its_times_were_taken_at(
    demo_cli, small_results
):
    out = demo_cli().rstrip().splitlines()
    assert any(line.startswith("Times measured at load average") for line in out)
    what, pick = out[-2:]
    full = [r for rows in small_results.values() for r in rows if r.mode == "full"]
    low, high = min(r.held_ratio for r in full), max(r.held_ratio for r in full)
    assert what.startswith(f"full holds {low * 100:.0f}-{high:.0%} of no AC's memory"), what
    assert "selective holds" in what and "replays 0% (norms" in what, what
    assert pick.startswith("Pick selective when") and "full when memory" in pick, pick


def test_compare_modes_says_when_each_phase_starts_and_restores_the_thread_count(capsys):
    threads = torch.get_num_threads()
    compare_modes("dense", modes=("none",), batch=1, seq_len=4, n_layers=1, repeats=1)
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1].split()[0] for line in err] == ["measuring", "timing"], err
    assert torch.get_num_threads() == threads


def test_compare_modes_small_model_counts_replayed_forward_flops(small_results):
    rows = {r.mode: r for r in small_results["dense"]}
    # Full mode replays the block's linears on 8 tokens in 2 blocks: wq, wo (64x64), wk, wv
    # (64x32), w1, w3 (64x128); w2 is not replayed because non-reentrant checkpoint stops the
    # recompute once every tensor the backward needs exists, and nothing needs w2's output.
    # Attention (4 heads of 16 on 8 tokens) is replayed too: QK^T and PV, 2 FLOPs per MAC.
    replayed_macs = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 2
    attention_flops = 2 * (2 * 4 * 8 * 8 * 16)
    assert rows["full"].recomputed_flops == 2 * (2 * 8 * replayed_macs + attention_flops)
    assert rows["selective"].recomputed_flops == 0


def test_help_has_no_markup_and_every_option_says_its_default():
    parser, _ = _parsers()
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        text = sub.format_help()
        assert "``" not in text and ":class:" not in text, name
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings} has no help text"
            assert "default" in sub._get_formatter()._expand_help(action), (name, action.dest)
    assert "``" not in parser.format_help()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "2", "--targets", "auto"], "argument --budget: '2' is neither a fraction"),
        (["--budget", "6 parsecs", "--targets", "auto"], "nor a peak with a unit (e.g. 6MiB"),
        (["--budget", "0.3"], "--budget applies only with --targets auto"),
        (["--targets", "auto"], "--targets auto needs --mode selective"),
        (["--targets", "aten:mm"], "argument --targets: invalid operator target 'aten:mm'"),
        (["--freq", "0"], "argument --freq: '0' is not an integer >= 1"),
    ],
)
def test_audit_errors_name_the_flag(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["audit", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "budget=" not in err and "targets=" not in err


@pytest.mark.slow
def test_the_readme_shows_the_demos_counts_and_summary():
    """The README's demo output, as printed: every deterministic column (bytes, replayed ops and
    FLOPs, gradient difference) of every row, and the closing summary. Times are not compared."""
    from pathlib import Path

    from prime_ac.demo import format_table, summary

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    sizes = prime_ac.demo.SIZES
    report = {kind: compare_modes(kind, repeats=1, **sizes[kind]) for kind in ("dense", "moe")}
    for kind, results in report.items():
        for line in format_table(kind, results, 1).splitlines()[3:]:
            counts = line[: line.index("e+") + 4]  # up to the gradient difference, 0.0e+00
            assert counts in readme, f"README.md lacks the demo's {kind} row {counts!r}"
    assert summary(report) in readme
