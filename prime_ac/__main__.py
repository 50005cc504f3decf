"""Command line: ``python -m prime_ac demo`` and ``python -m prime_ac audit``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime_ac", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train one step of built-in tiny models with no AC, full and selective"
    )
    demo.add_argument("--model", choices=["dense", "moe", "both"], default="both")
    demo.add_argument("--json", action="store_true", help="print the results as JSON")
    audit = commands.add_parser(
        "audit", help="report what a policy keeps and replays on a built-in model, per operator"
    )
    audit.add_argument("--model", choices=["dense", "moe"], default="dense")
    audit.add_argument("--mode", choices=["full", "selective"], default="selective")
    audit.add_argument(
        "--targets",
        help="comma-separated operator targets (default: prime_ac.DEFAULT_TARGETS), or 'auto'",
    )
    audit.add_argument(
        "--budget", type=float, help="with --targets auto: fraction of no-AC activation memory"
    )
    audit.add_argument("--freq", type=int, default=1)
    audit.add_argument("--json", action="store_true", help="print only the report, as JSON")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from prime_ac.demo import main as demo_main

        kinds = ["dense", "moe"] if args.model == "both" else [args.model]
        return demo_main(kinds, args.json)
    if args.command == "audit":
        return _audit(args)
    return 2


def _audit(args: argparse.Namespace) -> int:
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
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = prime_ac.audit(model, loss)
    print(report.to_json(indent=2) if args.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
