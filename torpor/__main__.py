"""``python -m torpor``: the torpor command line (same as the ``torpor`` script)."""

from __future__ import annotations

import sys

from torpor.cli import main

if __name__ == "__main__":
    sys.exit(main())
