"""Figures the fault suite measures while it runs, for the generated docs/RELIABILITY.md.

Invariant: every figure was observed by a test in this session (counted, sampled or timed) and
recorded once what it shows was checked, or it is a setting the test chose (a budget, a timeout,
a rate), recorded with ``setting`` and shown as one. Nothing is filled in by hand:
tests/unit/test_fault_figures.py refuses a constant passed to ``set``, ``add``, ``peak`` or
``low``. Keys are ``"sNN.name"`` for one scenario and ``"all.name"`` for the suite-wide totals
(bytes served and checked, daemons started, secrets found...).
"""

from __future__ import annotations

import threading
from typing import Any


class Figures:
    def __init__(self) -> None:
        self._mu = threading.Lock()
        self.values: dict[str, Any] = {}
        self.settings: set[str] = set()  # keys whose value the test chose, not measured
        self.outcomes: dict[str, str] = {}  # test node id -> passed | failed | skipped: reason

    def add(self, key: str, n: float = 1) -> None:
        with self._mu:
            self.values[key] = self.values.get(key, 0) + n

    def peak(self, key: str, value: float) -> None:
        """Keep the largest value seen (latencies, disk use, in-flight counts)."""
        with self._mu:
            old = self.values.get(key)
            self.values[key] = value if old is None else max(old, value)

    def low(self, key: str, value: float) -> None:
        """Keep the smallest value seen (gaps that must stay above a bound)."""
        with self._mu:
            old = self.values.get(key)
            self.values[key] = value if old is None else min(old, value)

    def set(self, key: str, value: Any) -> None:
        with self._mu:
            self.values[key] = value

    def setting(self, key: str, value: Any) -> None:
        """A value the test chose (a budget, a timeout): shown as a setting, not a measurement."""
        with self._mu:
            self.values[key] = value
            self.settings.add(key)

    def is_setting(self, key: str) -> bool:
        with self._mu:
            return key in self.settings

    def get(self, key: str, default: Any = None) -> Any:
        with self._mu:
            return self.values.get(key, default)

    def scenario(self, sid: str) -> dict[str, Any]:
        prefix = sid + "."
        with self._mu:
            return {k[len(prefix):]: v for k, v in sorted(self.values.items()) if k.startswith(prefix)}


FIGURES = Figures()
