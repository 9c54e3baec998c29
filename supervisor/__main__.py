"""`python -m sandbox_supervisor.daemon`: the same entry point as the `sandbox-supervisor` script."""

from sandbox_supervisor.daemon.ops.cli import main

raise SystemExit(main())
