"""The demo from start to end: pick the device, build the workload, serve metrics, run the cycles, say where to look."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from torpor.demo.cycles import CYCLE_KINDS, render, run_cycle
from torpor.demo.gpu import GpuWorkload
from torpor.demo.sim import SimWorkload
from torpor.demo.workload import Workload
from torpor.errors import BadArgument, DemoError, MissingExtra, PoolBusy, TorporError
from torpor.extras import available
from torpor.statemachine import SleepController, log_path_for
from torpor.telemetry.grafana import render_dashboard
from torpor.telemetry.server import serve
from torpor.telemetry.timeline import plot
from torpor.textout import Progress
from torpor.units import byte_size

DEVICES = ("auto", "cuda", "sim")
GRAFANA_CURL = (
    "$ curl -u admin:admin -H 'Content-Type: application/json' -d @{} http://localhost:3000/api/dashboards/db"
)
ENGINE = "demo"
#: The exit status of a demo that Ctrl-C ended (128 + SIGINT), as docs/cli.md gives for every command.
EXIT_CTRL_C = 130


@dataclass
class DemoOptions:
    """What ``torpor demo`` takes on its command line."""

    cycles: int = 3
    device: str = "auto"
    port: int = 0
    host: str = "127.0.0.1"
    log_dir: Path | None = None
    keep_serving: bool = False
    out: TextIO = field(default_factory=lambda: sys.stdout)


def cuda_available() -> bool:
    """True when torch sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pick_device(requested: str) -> tuple[str, str]:
    """(device, why): ``cuda`` when asked or available, else ``sim``; ValueError when cuda is asked for and absent."""
    if requested not in DEVICES:
        msg = f"--device must be one of {', '.join(DEVICES)}, got {requested!r}"
        raise BadArgument(msg)
    if requested == "sim":
        return "sim", "asked for with --device sim"
    if cuda_available():
        return "cuda", "CUDA is available" if requested == "auto" else "asked for with --device cuda"
    if not available("torch"):
        if requested == "cuda":
            raise MissingExtra("the GPU demo (--device cuda)", "torch")
        return "sim", "torch is not installed; pip install '.[cuda]' from a torpor checkout for the GPU demo"
    if requested == "cuda":
        msg = "--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); use --device sim"
        raise BadArgument(msg)
    return "sim", "no CUDA device found (torch.cuda.is_available() is False)"


def make_workload(device: str) -> Workload:
    """The workload for ``device``; DemoError when the allocator it needs is missing."""
    try:
        if device == "cuda":
            return GpuWorkload()
        return SimWorkload()
    except ImportError as exc:
        msg = f"the {device} demo needs {exc.name or 'a module'} which cannot be imported here ({exc})"
        raise DemoError(msg) from exc


def _serve(controller: SleepController, port: int, host: str) -> tuple[Any, str]:
    """Start the metrics endpoint; (server or None, a line saying where or why not)."""
    try:
        server = serve(controller, port=port, host=host)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:  # the host, not the port
            hint = f"--host {host} is no address of this machine; give one it has (127.0.0.1, ::1, 0.0.0.0 for all)"
        else:  # in use, or a privileged port
            hint = "pick another --port, or 0 for any free one"
        msg = f"cannot serve metrics on {host}:{port}: {why}; {hint}"
        raise DemoError(msg) from exc
    return server, f"{server.url.rstrip('/')}/metrics   (also /state and /events?after=SEQ)"


def torpor_command() -> str:
    """How the user runs torpor: ``torpor`` when that is on PATH, else the script as invoked (``.venv/bin/torpor``)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) != "torpor" or not os.path.exists(argv0):
        return "torpor"
    found = shutil.which("torpor")
    if found and os.path.samefile(found, argv0):
        return "torpor"
    return argv0


def _artifacts(log: Path, out_dir: Path) -> list[tuple[str, str, str]]:
    """Write the timeline PNG and the Grafana dashboard; (what, where, how to look) per artifact."""
    torpor = torpor_command()
    found: list[tuple[str, str, str]] = [
        ("event log", str(log), f"$ {torpor} log show {log}"),
        ("replayed state", f"$ {torpor} log replay {log}", ""),
    ]
    png = out_dir / "timeline.png"
    try:
        plot(log, png, title="torpor demo")
        found.append(("timeline PNG", str(png), f"$ xdg-open {png}"))
    except ImportError as exc:
        hint = "pip install '.[plot]' from a torpor checkout" if exc.name == "matplotlib" else str(exc)
        found.append(("timeline PNG", "not written: matplotlib is not installed", f"$ {hint}"))
    dash = out_dir / "grafana-dashboard.json"
    try:
        text = render_dashboard()
        dash.write_text(text)
        # the same, wrapped for Grafana's HTTP API, so one curl line loads it
        api = out_dir / "grafana-import.json"
        api.write_text('{"overwrite": true, "dashboard": ' + text.strip() + "}\n")
        found.append(("Grafana dashboard", f"{dash}   (Dashboards > New > Import, or:)", GRAFANA_CURL.format(api)))
    except ImportError as exc:
        found.append(("Grafana dashboard", f"not written ({exc})", ""))
    return found


def run_demo(opts: DemoOptions) -> int:
    """Run the demo; 0 when every wake was exact, 1 otherwise, 130 when Ctrl-C ended ``--keep-serving``."""
    out = opts.out

    def say(line: str = "") -> None:
        progress.clear()
        out.write(line + "\n")
        out.flush()

    if opts.cycles < 1:
        msg = f"--cycles must be at least 1, got {opts.cycles}"
        raise BadArgument(msg)
    if not 0 <= opts.port <= 65535:
        msg = f"--port must be 0 (any free port) to 65535, got {opts.port}"
        raise BadArgument(msg)
    device, why = pick_device(opts.device)
    log_dir = Path(opts.log_dir) if opts.log_dir else Path(tempfile.mkdtemp(prefix="torpor-demo-"))
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # one line naming the directory, not a bare "[Errno 2]" or "File exists"
        why = exc.strerror or str(exc)
        if isinstance(exc, FileExistsError):
            why = "it is a file, not a directory" if log_dir.is_file() else "it exists and is not a directory"
        msg = (
            f"cannot use --log-dir {log_dir}: {why} "
            "(give a directory you can create and write, or leave --log-dir out for a new temp dir)"
        )
        raise BadArgument(msg) from None
    log = log_path_for(log_dir, ENGINE, 0)
    kinds = [CYCLE_KINDS[i % len(CYCLE_KINDS)] for i in range(opts.cycles)]
    progress = Progress(out, total=3 + sum(1 + 2 * len(k.wakes) for k in kinds))

    progress.step("building the workload")
    try:
        workload = make_workload(device)
    except (TorporError, RuntimeError, OSError) as exc:
        if opts.device != "auto":
            raise
        why = f"CUDA is available, but torpor cannot use it here: {exc}"
        device, workload = "sim", make_workload("sim")
    say(f"torpor demo: {opts.cycles} sleep/wake cycle(s) on device '{device}' ({why})")
    for line in workload.describe():
        say("  " + line)
    controller = SleepController(workload.memory, log=log, engine=ENGINE, rank=0)
    if controller.projection.interrupted:
        say(f"  the log in {log_dir} ends mid-transition ({controller.projection.last_step}): recovering")
        controller.recover()
    server: Any = None
    try:
        server, where = _serve(controller, opts.port, opts.host)
        say(f"  metrics    {where}")
        say(f"  event log  {log}")
        say()
        progress.step("allocating, filling and capturing graphs")
        start = time.perf_counter()
        workload.setup(controller)
        progress.advance()
        usage = controller.projection.residency
        total = sum(u.resident for u in usage.values())
        tags = ", ".join(f"{t} {byte_size(u.resident)}" for t, u in sorted(usage.items()))
        say(f"awake: {byte_size(total)} tagged ({tags}); set up in {time.perf_counter() - start:.2f} s")
        say()
        exact = True
        for i, kind in enumerate(kinds):

            def step(text: str, i: int = i) -> None:
                progress.step(f"cycle {i + 1}/{opts.cycles}: {text}")
                progress.advance()

            result = run_cycle(controller, workload, i + 1, kind, step, dwell=0.1)
            exact = exact and result.exact
            say(render(result, opts.cycles))
            say()
        progress.step("releasing the graph pool")
        _release_pool(controller, workload, say)
        progress.advance()
        progress.step("writing the timeline and the dashboard")
        found = _artifacts(log, log_dir)
        progress.advance()
        verdict = "every wake was bit-exact" if exact else "SOME WAKES WERE NOT EXACT (see the tables above)"
        say(f"done: {opts.cycles} cycle(s), {verdict}; final state {controller.state.value}")
        width = max(len(w) for w, _, _ in found)
        for what, path, how in found:
            say(f"  {what.ljust(width)}  {path}")
            if how:
                say(f"  {''.ljust(width)}  {how}")
        if server is not None and _keep_serving(server, opts.keep_serving, say) == signal.SIGINT:
            return EXIT_CTRL_C  # Ctrl-C ended it, as every command reports Ctrl-C
        return 0 if exact else 1
    finally:
        progress.clear()
        if server is not None:
            server.close()
        controller.close()
        workload.close()


def _release_pool(controller: SleepController, workload: Workload, say: Callable[[str], None]) -> None:
    """Show the pool guard: release refused while graphs live (naming them), done once they are dropped."""
    try:
        controller.release_cudagraph_pool()
    except PoolBusy as exc:
        holders = f"{len(exc.holders)} holder(s), e.g. {exc.holders[0]}" if exc.holders else str(exc)
        say(f"graph pool: release refused while graphs are alive ({holders})")
    workload.drop_graphs()
    try:
        freed = controller.release_cudagraph_pool()
    except TorporError as exc:
        say(f"graph pool: not released after dropping the graphs: {exc}")
        return
    say(f"graph pool: released {byte_size(freed)} once the graphs were dropped; the next capture starts a fresh pool")
    say("")


def _keep_serving(server: Any, keep: bool, say: Callable[[str], None]) -> signal.Signals | None:
    """With ``keep``, serve until Ctrl-C or SIGTERM and return the signal that ended it; else say it closes (None)."""
    url = f"{server.url.rstrip('/')}/metrics"
    if not keep:
        say(f"  {'metrics'.ljust(17)}  {url} (closed now; --keep-serving keeps it up for a Prometheus)")
        return None
    stopped: list[signal.Signals] = []
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stopped.append(signal.Signals(signum))
        stop.set()

    restore: list[tuple[signal.Signals, Any]] = []
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C and SIGTERM (docker stop, systemd) end the serving, also when the shell that started
        # the demo in the background left SIGINT ignored. Installed before saying so: whoever reads
        # the line below may signal at once.
        for signum in (signal.SIGINT, signal.SIGTERM):
            restore.append((signum, signal.signal(signum, on_signal)))
    try:
        say(
            f"serving {url} until Ctrl-C; point a Prometheus scrape job at it (static_configs: ['{url.split('/')[2]}'])"
        )
        say(f"  $ curl -s {url} | grep '^torpor_'")
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        stopped.append(signal.SIGINT)
    finally:
        for sig, handler in restore:
            signal.signal(sig, handler)
    say("stopped serving")
    return stopped[0] if stopped else None
