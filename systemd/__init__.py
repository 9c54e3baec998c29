"""The systemd units and the example configuration, as package data.

This directory is installed as `sandbox_supervisor.units` (pyproject.toml's package-dir), so the
wheel carries the very files kept here; `sandbox-supervisor install-units` writes them out. The
`__init__.py` makes it a regular package: a namespace package would do for a wheel, but in an
editable install Python 3.11's importlib.resources cannot read one (setuptools' finder adds a
placeholder path that is not a directory).
"""
