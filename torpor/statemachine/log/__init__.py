"""The event store: the checked line format, the files on disk, the writer, the readers, the tailer and the fan-out.

It owns how events are kept and read back: :mod:`.checks` (what a payload must
hold to be read), :mod:`.codec` and :mod:`.framing` (one checksummed JSON line),
:mod:`.files` (opening log files safely), :mod:`.eventlog` (``EventLog``, the writer),
:mod:`.reader` (``read_events``, ``replay``), :mod:`.tail` (the one tailer every
reader uses), :mod:`.follow` (a live log followed: ``torpor.hooks.follow``),
:mod:`.fanout` (subscribers), :mod:`.logsource` (``LogSource``: a log another process writes, replayed then tailed) and :mod:`.interrupts` (signals held off a write). It imports the core and the projection (a snapshot holds one), never
the machine above it, the allocator, hooks, telemetry or torch.
"""
