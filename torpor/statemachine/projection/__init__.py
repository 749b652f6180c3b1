"""The projection: the state of one controller as a fold over its events, and the data it holds.

It owns :mod:`.data` (the fields of a projection), :mod:`.fold` (one step per event
kind) and :mod:`.view` (:class:`~torpor.statemachine.projection.view.Projection`,
folding events and checking them). It imports only :mod:`torpor.statemachine.core`
and :mod:`torpor.errors`: never the log that stores the events, the machine that
appends them, threads, I/O or torch.
"""
