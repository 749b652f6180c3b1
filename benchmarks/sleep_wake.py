"""Run the sleep/wake benchmark (same as ``torpor bench``): python benchmarks/sleep_wake.py [--out DIR] [--no-sweep]."""

from __future__ import annotations

import sys

from torpor.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
