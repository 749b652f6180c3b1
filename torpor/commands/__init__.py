"""Subcommands of the ``torpor`` CLI, one module each (see ``torpor.cli``)."""
