"""Command line: python -m prime_ac demo, audit and plan (CPU, built-in tiny models)."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default; flags and unset options say theirs in their help text."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def _budget(text: str) -> float | str:
    """A fraction in [0, 1] of the no-AC activation memory, or the step's peak with a unit."""
    from prime_ac.planner import parse_bytes

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if 0.0 <= value <= 1.0:
        return value
    if not text.strip().replace(".", "", 1).isdigit():  # bytes need a unit: '24GiB'
        try:
            parse_bytes(text)
            return text
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a fraction in [0, 1] of the whole model's no-AC activation memory "
        "(e.g. 0.3) nor a peak with a unit (e.g. 6MiB; units B, KB, MB, GB, KiB, MiB, GiB)"
    )


def _bandwidth(text: str) -> float:
    """A finite rate > 0: a copy time divided by 0, nan or inf plans nothing sensible."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a copy bandwidth: give bytes per second as a finite number > 0, "
            "e.g. 12e9"
        )
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return int(text)


def _html_file(text: str) -> str:
    """A file the page can be written to, checked before the step runs."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder: name the file to write")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: its folder {folder!r} does not exist")
    return text


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="python -m prime_ac", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,audit,plan}")
    demo = commands.add_parser(
        "demo",
        formatter_class=_Help,
        help="train built-in models with no AC, plain, full and selective AC; compare",
        description="Train the built-in models one step per checkpoint mode and print what each "
        "mode holds for backward, replays and costs; exits 1 if any gradient differs from no AC.",
    )
    demo.add_argument(
        "--model", choices=["dense", "moe", "both"], default="both", help="built-in model(s)"
    )
    demo.add_argument(
        "--tiny",
        action="store_true",
        help="the built-in tiny models (width 64, 4 x 128 tokens): seconds, for quick checks, "
        "where per-operator dispatch outweighs FLOPs (default: off, blocks of width 512 on 512 "
        "tokens, whose times order the modes as at real sizes)",
    )
    demo.add_argument(
        "--repeats",
        type=_positive_int,
        default=5,
        help="timed rounds (one step per mode each) after one warm-up round; times are medians",
    )
    demo.add_argument(
        "--json", action="store_true", help="print the results as JSON only (default: a table)"
    )
    audit = commands.add_parser(
        "audit",
        formatter_class=_Help,
        help="report what a policy keeps and replays on a built-in model, per operator",
        description="Checkpoint a built-in model's blocks, run one step and report per block and "
        "operator what the policy keeps for backward, replays and what that costs.",
    )
    audit.add_argument("--model", choices=["dense", "moe"], default="dense", help="built-in model")
    audit.add_argument(
        "--mode", choices=["full", "selective"], default="selective", help="checkpoint mode"
    )
    audit.add_argument(
        "--targets",
        help="comma-separated operator targets kept in selective mode (ns, ns::op or "
        "ns::op.overload), or 'auto' to choose them within --budget (default: "
        "prime_ac.DEFAULT_TARGETS: attention, matrix products, communication)",
    )
    audit.add_argument(
        "--budget",
        type=_budget,
        help="the step's peak activation memory with a unit, e.g. 6MiB, or a fraction of the "
        "whole model's no-AC activation memory, e.g. 0.3 (default: unset; needed with "
        "--targets auto, and only there)",
    )
    audit.add_argument(
        "--freq", type=_positive_int, default=1, help="checkpoint every freq-th block"
    )
    audit.add_argument(
        "--json", action="store_true", help="print only the report, as JSON (default: a table)"
    )
    audit.add_argument(
        "--html",
        metavar="FILE",
        type=_html_file,
        help="also write the step's memory as one self-contained HTML page to FILE (held bytes "
        "per block's forward and backward, the measured peak; prime_ac.report_html; default: no "
        "page)",
    )
    plan = commands.add_parser(
        "plan",
        formatter_class=_Help,
        help="plan keep / offload / replay per operator call under a peak-memory budget",
        description="Profile one step of a built-in model and print, per block and operator "
        "call, what the peak planner (prime_ac.planner) chooses, its bytes, each block's "
        "predicted exposed copy time and the predicted peak.",
    )
    plan.add_argument(
        "--budget",
        required=True,
        help="peak activation memory with a unit, e.g. 24GiB (required: no default; a bare "
        "number is refused: the fraction audit --targets auto takes is not a peak)",
    )
    plan.add_argument("--model", choices=["dense", "moe"], default="dense", help="built-in model")
    plan.add_argument(
        "--bandwidth",
        type=_bandwidth,
        default=None,
        help="host-device copy bandwidth in bytes/s (default: prime_ac.planner.DEFAULT_BANDWIDTH)",
    )
    plan.add_argument(
        "--host-cap",
        default=None,
        help="most host memory to offload to, e.g. 64GiB (default: no cap)",
    )
    plan.add_argument(
        "--html",
        metavar="FILE",
        type=_html_file,
        help="also write the planned step's memory as one self-contained HTML page to FILE "
        "(held bytes per block's forward and backward, the budget and predicted peak; default: "
        "no page)",
    )
    parser.plan_parser = plan  # type: ignore[attr-defined]
    return parser, audit


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    import prime_ac
    from prime_ac import planner
    from prime_ac.budget import profiles
    from prime_ac.models import build_model

    try:
        budget = planner.parse_bytes(args.budget, "--budget")
        host_cap = (
            None if args.host_cap is None else planner.parse_bytes(args.host_cap, "--host-cap")
        )
    except ValueError as exc:
        bare = str(exc).startswith("--budget=") and "no unit" in str(exc)
        parser.error(
            f"{exc}" + ("; plan takes a peak, a fraction applies to audit --targets auto" * bare)
        )
    model = build_model(args.model)
    tokens = torch.randint(
        0, model.cfg.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0)
    )
    prime_ac.checkpoint_blocks(model, mode="full")
    report = prime_ac.audit(model, lambda m: m.loss(tokens))
    chosen = planner.plan(
        profiles(report),
        budget,
        bandwidth=planner.DEFAULT_BANDWIDTH if args.bandwidth is None else args.bandwidth,
        host_cap=host_cap,
    )
    print(chosen.table())
    if args.html:
        from prime_ac.report_html import write

        write(report, args.html, plan=chosen)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, audit = _parsers()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from prime_ac.demo import main as demo_main

        kinds = ["dense", "moe"] if args.model == "both" else [args.model]
        return demo_main(kinds, args.json, repeats=args.repeats, tiny=args.tiny)
    if args.command == "plan":
        return _plan(args, parser.plan_parser)
    if args.targets == "auto" and (args.budget is None or args.mode != "selective"):
        audit.error(
            "--targets auto needs --mode selective (the default) and --budget (0.3 or 6MiB)"
        )
    if args.budget is not None and args.targets != "auto":
        audit.error("--budget applies only with --targets auto")
    return _audit(args, audit)


def _audit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    import prime_ac
    from prime_ac.models import build_model

    model = build_model(args.model)
    tokens = torch.randint(
        0, model.cfg.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0)
    )

    def loss(m):
        return m.loss(tokens)

    targets = args.targets
    if targets is not None and targets != "auto":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    try:
        prime_ac.checkpoint_blocks(
            model,
            mode=args.mode,
            freq=args.freq,
            targets=targets,
            budget=args.budget,
            profile=loss if targets == "auto" else None,
        )
    except (TypeError, ValueError) as exc:
        # The flags are checked above, so what is left is a bad target; the library names its
        # Python arguments (targets=...), the command line names the flags.
        message = re.sub(r"\b(targets|budget|freq|mode)=", r"--\1 ", str(exc))
        parser.error(message if "--" in message else f"argument --targets: {message}")
    report = prime_ac.audit(model, loss)
    print(report.to_json(indent=2) if args.json else report)
    if args.html:
        from prime_ac.measure import measure_peak

        measured = None if report.peak is None else report.peak[2]
        if measured is None:  # one more step, measured
            measured = measure_peak(model, loss)
            model.zero_grad(set_to_none=True)
        report.to_html(args.html, measured_peak=measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
