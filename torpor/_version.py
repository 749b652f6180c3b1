"""The version of torpor."""

__version__ = "0.1.0"  # the one place the version is written (pyproject reads it: tool.setuptools.dynamic)
