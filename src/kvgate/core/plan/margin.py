"""Feedback on measured KV usage: the margin that keeps the envelope's ceilings honest.

Admission plans each node's future peak from the requests it placed there (the envelope).
The plan can be wrong in one dangerous direction: the engine holds more than planned,
because requests ran longer than their learned length, prompts were under-estimated, or
traffic reached the engine without passing through this gateway. A sample then shows more
than the peak that was planned for the node just before it: if the plan were right, what
the engine holds now could not exceed the highest it was planned to hold.

`MarginController` turns that evidence into a margin subtracted from the node's ceilings for
non-critical work. It is a PI loop with a one-sided error and a leaky integral:

    e      = measured usage - target      target = min(planned peak + tolerance, panic)
    I     += KI * e * dt                              while e > 0
    I     *= 2 ** (-dt / HALFLIFE_S)                  while e <= 0 (the evidence ages)
    margin = clamp(KP * e + I, 0, span)

While the plan holds, the loop stays at zero and costs nothing. An excess lowers the
ceilings at once (P) and, if it persists, further (I), so the node takes less new work until
it is back within the plan; then the margin fades over a few half-lives. The gains are
fixed: the error is a fraction of capacity and the output the same unit, so `KP = 1` means
"hold back as much as the plan missed", and `KI` doubles that within a quarter of a second
of a sustained excess. The feedback acts after the fact: it cannot undo what an
under-estimated burst already placed (`benchmarks/controller_choice/results.md`).
"""

from __future__ import annotations

KP = 1.0
KI = 4.0
HALFLIFE_S = 5.0
MAX_DT_S = 1.0


class MarginController:
    """One node's margin (a fraction of capacity) below its ceilings."""

    __slots__ = ("_at", "_integral", "margin", "span")

    def __init__(self, span: float) -> None:
        if span <= 0:
            raise ValueError("the margin's span must be positive")
        self.span = span
        self.margin = 0.0
        self._integral = 0.0
        self._at: float | None = None

    def update(self, now: float, measured: float, target: float) -> float:
        """Take one measured usage (0-1) against `target`; returns the new margin."""
        dt = 0.0 if self._at is None else min(MAX_DT_S, max(0.0, now - self._at))
        self._at = now
        error = measured - target
        if error > 0:
            self._integral = min(self.span, self._integral + KI * error * dt)
            raw = KP * error + self._integral
        else:
            self._integral *= 2.0 ** (-dt / HALFLIFE_S)
            if self._integral < 1e-4:
                self._integral = 0.0
            raw = self._integral
        self.margin = min(self.span, max(0.0, raw))
        return self.margin
