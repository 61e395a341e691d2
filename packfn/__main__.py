"""``python -m packfn <command>``: the package's commands.

- ``budgets``: propose a budget and a document cap for a tokenized dataset,
  print the fill per budget and cap, draw a PNG (:mod:`packfn.data.report`).
"""

from __future__ import annotations

import argparse

from packfn.data import report

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (``sys.argv[1:]`` when None); its exit status."""
    parser = argparse.ArgumentParser(prog="python -m packfn", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(title="commands", dest="command", required=True)
    report.add_budgets_command(commands)
    arguments = parser.parse_args(argv)
    return arguments.run(arguments)


if __name__ == "__main__":
    raise SystemExit(main())
