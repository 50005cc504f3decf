"""Command line: ``python -m prime_ac demo``."""

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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from prime_ac.demo import main as demo_main

        kinds = ["dense", "moe"] if args.model == "both" else [args.model]
        return demo_main(kinds, args.json)
    return 2


if __name__ == "__main__":
    sys.exit(main())
