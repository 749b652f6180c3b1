"""An RL loop that drives a ``vllm serve`` engine through its HTTP API and follows it with torpor's client.

Between rollouts the trainer needs the GPU: the loop puts the engine to sleep
(``POST /sleep?level=1``: weights to host, KV cache discarded), confirms on
every rank that the memory is released (the client long-polls torpor's
``/torpor/events`` and reads ``/torpor/state``), trains, wakes the weights
(``POST /wake_up?tags=weights``: here a real loop pushes the new weights),
then the KV cache (``POST /wake_up?tags=kv_cache``), and reports what each
sleep and wake cost, from the engine's own events.

Start the engine (vLLM's /sleep and /wake_up need its dev mode)::

    VLLM_SERVER_DEV_MODE=1 VLLM_PLUGINS=torpor vllm serve Qwen/Qwen3-0.6B \\
        --enable-sleep-mode --sleep-mode-backend torpor

Run: ``python examples/rl_loop.py --url http://127.0.0.1:8000 --steps 3 [--ranks 2]``
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from torpor.client import Client
from torpor.errors import TorporError
from torpor.statemachine.core.events import EventKind


def post(url: str, path: str, params: list[tuple[str, str]] | None = None, timeout: float = 600.0) -> Any:
    """POST to one of vLLM's routes; return its JSON answer."""
    query = urllib.parse.urlencode(params or [])
    request = urllib.request.Request(f"{url}{path}" + (f"?{query}" if query else ""), method="POST")  # noqa: S310
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        return json.loads(response.read() or b"null")


def rl_loop(
    url: str,
    steps: int,
    train: Callable[[int], None],
    *,
    ranks: int = 1,
    timeout: float = 300.0,
) -> list[dict[str, float]]:
    """Run ``steps`` sleep / train / wake rounds against the engine at ``url``; return each round's durations."""
    clients = [Client(url, rank=r, timeout=30.0) for r in range(ranks)]
    for client in clients:
        client.wait_for("awake", timeout=timeout)  # the engine is up and every rank is serving
    report = []
    for step in range(steps):
        marks = [client.last_seq for client in clients]
        # ... rollouts: generation requests to /v1/completions go here ...
        post(url, "/sleep", [("level", "1")])
        for client in clients:
            client.wait_for("asleep_l1", timeout=timeout)  # every rank released its memory: the GPU is free
        train(step)
        post(url, "/wake_up", [("tags", "weights")])
        for client in clients:
            client.wait_for("partially_awake", timeout=timeout)
        # ... push the new weights into the engine here (they are mapped back, at the same addresses) ...
        post(url, "/wake_up", [("tags", "kv_cache")])
        for client in clients:
            client.wait_for("awake", timeout=timeout)
        round_: dict[str, float] = {"step": float(step)}
        for rank, (client, mark) in enumerate(zip(clients, marks, strict=True)):
            for event in client.events(after=mark):
                if event.kind is EventKind.SLEEP_COMPLETED:
                    round_[f"rank{rank}_sleep_s"] = float(event.data.get("seconds", 0.0))
                elif event.kind is EventKind.WAKE_COMPLETED:
                    key = f"rank{rank}_wake_{'_'.join(event.data.get('tags') or ['all'])}_s"
                    round_[key] = float(event.data.get("seconds", 0.0))
        report.append(round_)
    return report


def main() -> int:
    """Run the loop with a trainer that does nothing but say so; an engine that refuses is one line and exit 1."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1, help="tensor-parallel ranks to confirm")
    args = parser.parse_args()
    try:
        for round_ in rl_loop(args.url, args.steps, lambda step: print(f"step {step}: training"), ranks=args.ranks):
            print(json.dumps(round_))
    except urllib.error.HTTPError as exc:  # vLLM's own routes: /sleep and /wake_up exist only in its dev mode
        why = f"{exc.url} answered {exc.code} {exc.reason}"
        print(f"rl_loop: {why} (vLLM serves /sleep and /wake_up with VLLM_SERVER_DEV_MODE=1)", file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"rl_loop: cannot reach the engine at {args.url}: {exc.reason}", file=sys.stderr)
        return 1
    except (TorporError, OSError) as exc:  # torpor's client: the endpoint refused, or a rank never got there
        print(f"rl_loop: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
