"""Put on ``PYTHONPATH`` by ``python -m torpor.tms.tmsrun``: every Python child starts with the switch on.

Imported by ``site`` as ``sitecustomize`` at interpreter start; activates the
switch (``TORPOR_TMS=1`` is set by the runner), then runs the
``sitecustomize`` it shadows, if the environment has one.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

from torpor.tms.switch import activate

activate()

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:  # the environment's own sitecustomize, which this one shadows
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
