"""`python -m supervisor`: the same entry point as the `sandbox-supervisor` script."""

from supervisor.cli import main

raise SystemExit(main())
