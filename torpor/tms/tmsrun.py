"""``python -m torpor.tms.tmsrun SCRIPT|-m MODULE [ARGS]``: run a program with the switch on, children too.

For where the ``torpor-tms.pth`` is not installed (a source checkout on
``PYTHONPATH``, an editable install whose ``.pth`` was not written): sets
``TORPOR_TMS=1``, puts :mod:`torpor.tms.boot` first on ``PYTHONPATH`` (its
``sitecustomize`` turns the switch on in every Python child), turns it on
here, and runs the program as ``python`` would: ``sys.path[0]`` the script's
directory (not the current one ``-m`` put there), a script or module that
cannot be run said in ``python``'s words and exit status, one line.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from pathlib import Path

from torpor.tms.switch import ENV, install

BOOT = Path(__file__).resolve().parent / "boot"
PROG = "python -m torpor.tms.tmsrun"
USAGE = f"usage: {PROG} SCRIPT [ARGS] | -m MODULE [ARGS]"


def prepare(environ: dict[str, str] | None = None) -> None:
    """Set ``TORPOR_TMS=1`` and the boot directory first on ``PYTHONPATH`` in ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    env[ENV] = "1"
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = f"{BOOT}{os.pathsep}{rest}" if rest else str(BOOT)


def refused(args: list[str]) -> str | None:
    """Why ``args`` name no program to run (the line to print before the usage), None when they name one."""
    if not args or args[0] in ("-h", "--help"):
        return ""
    if args[0] == "-m":
        return None if len(args) > 1 else "-m needs a MODULE"
    if args[0] == "-c":
        return f"-c is not taken: torpor runs no code string (put the code in a file and run {PROG} FILE)"
    if args[0].startswith("-"):
        return (
            f"unknown option {args[0]} (python's own options go before -m: python {args[0]} -m torpor.tms.tmsrun ...)"
        )
    return None


def script_error(script: str) -> tuple[str, int] | None:
    """What ``python SCRIPT`` says, and its exit status, when ``script`` cannot be run; None when it can."""
    path = Path(script)
    if path.is_dir():
        return None if (path / "__main__.py").is_file() else (f"can't find '__main__' module in {script!r}", 1)
    try:
        path.open("rb").close()
    except OSError as exc:
        return f"can't open file {str(path.absolute())!r}: [Errno {exc.errno}] {exc.strerror}", 2
    return None


def module_error(module: str) -> str | None:
    """What ``python -m MODULE`` says when ``module`` cannot be run (not found, a package without ``__main__``)."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is None:
            return f"No module named {module}"
        if spec.submodule_search_locations is not None and importlib.util.find_spec(f"{module}.__main__") is None:
            return f"No module named {module}.__main__; {module!r} is a package and cannot be directly executed"
    except (ImportError, ValueError) as exc:
        return f"Error while finding module specification for {module!r} ({type(exc).__name__}: {exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the program in ``argv`` (default ``sys.argv[1:]``) with the switch on; its exit status.

    What cannot be run is one line on stderr with python's own words and exit
    status (2: usage or a script that cannot be opened; 1: a module not found).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    why = refused(args)
    if why is not None:
        print(f"{PROG}: {why}\n{USAGE}" if why else USAGE, file=sys.stderr)  # noqa: T201 -- a command line's usage
        return 2
    if args[0] == "-m":
        error = module_error(args[1])
        status = 1
    else:
        error, status = script_error(args[0]) or (None, 0)
    if error is not None:
        print(f"{PROG}: {error}", file=sys.stderr)  # noqa: T201 -- a command line's one-line refusal
        return status
    prepare()
    install()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        if not sys.flags.safe_path and sys.path:  # as python SCRIPT: the script's directory instead of -m's cwd
            sys.path[0] = str(Path(args[0]).resolve().parent)
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
