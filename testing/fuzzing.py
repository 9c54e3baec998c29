"""How many inputs a fuzz test feeds its parser.

The suite runs every fuzz test (marker `fuzz`) with the modest count written at the test, so
the whole suite stays fast. The adversarial target (bench/README.md, "Targets": at least
10,000 inputs per network- or agent-facing parser, no crash, no hang) is met by the same
tests with the count raised from the environment:

    SUPERVISOR_FUZZ_EXAMPLES=10000 .venv/bin/python -m pytest -q -m fuzz

A count set at a test is only ever raised by the variable, never lowered.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

FUZZ_EXAMPLES_VARIABLE = "SUPERVISOR_FUZZ_EXAMPLES"


def fuzz_examples(default: int) -> int:
    raised = os.environ.get(FUZZ_EXAMPLES_VARIABLE, "").strip()
    return max(default, int(raised)) if raised else default


def fuzz_settings(default: int) -> settings:
    """Hypothesis settings for a fuzz test: `default` inputs (or the raised count), no
    per-input deadline (a hang is caught by the parser's own bounds, not by a timer)."""
    return settings(
        max_examples=fuzz_examples(default),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
