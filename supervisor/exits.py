"""The daemon's exit statuses, defined once for the daemon and its command line (README,
"Command line"; the systemd unit's RestartPreventExitStatus names 78)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_CRASH = 1  # a listener could not be opened at start, or an unexpected error
EXIT_CONFIG = 2  # bad configuration or arguments (argparse uses 2 as well)
EXIT_TERMINATED = 78
# Stopped by SIGUSR2 to be restarted, leaving held processes running (EX_TEMPFAIL): the unit
# restarts it (Restart=on-failure counts it), and the next daemon adopts them.
EXIT_RESTART = 75  # terminated after a bootstrap rejection: a terminated sandbox stays down
