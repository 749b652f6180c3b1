"""The machine's vocabulary: event kinds and their payload classes, the states, the tag policy and the memory protocol.

It owns what every other part of torpor speaks: :mod:`.kinds` and :mod:`.payloads`
(what each event says), :mod:`.events` (the event itself), :mod:`.states`
(states and the allowed transitions), :mod:`.policy` (what each tag does at each
level), :mod:`.protocol` (what the controller asks of device memory),
:mod:`.timeouts` (the one rule for a timeout in seconds) and :mod:`.enginename`
(the one rule for an engine name, wherever one enters). Pure
data and checks: it imports nothing of torpor but :mod:`torpor.errors`, no I/O,
no threads, no torch, and nothing of the projection, the log or the machine above it.
"""
