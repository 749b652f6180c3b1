"""``python -m torpor.tms.tmsrun SCRIPT|-m MODULE [ARGS]``: run a program with the switch on, children too.

For where the ``torpor-tms.pth`` is not installed (a source checkout on
``PYTHONPATH``, an editable install whose ``.pth`` was not written): sets
``TORPOR_TMS=1``, puts :mod:`torpor.tms.boot` first on ``PYTHONPATH`` (its
``sitecustomize`` turns the switch on in every Python child), turns it on
here, and runs the program as ``python`` would.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from torpor.tms.switch import ENV, install

BOOT = Path(__file__).resolve().parent / "boot"
USAGE = "usage: python -m torpor.tms.tmsrun SCRIPT [ARGS] | -m MODULE [ARGS]"


def prepare(environ: dict[str, str] | None = None) -> None:
    """Set ``TORPOR_TMS=1`` and the boot directory first on ``PYTHONPATH`` in ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    env[ENV] = "1"
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = f"{BOOT}{os.pathsep}{rest}" if rest else str(BOOT)


def main(argv: list[str] | None = None) -> int:
    """Run the program in ``argv`` (default ``sys.argv[1:]``) with the switch on; its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2) or args[0] == "-c":
        print(USAGE, file=sys.stderr)  # noqa: T201 -- a command line's usage
        return 2
    prepare()
    install()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
