"""tiered_kv/steps.py: drain runs a step-wise call to its end and returns its result."""

from __future__ import annotations

from tiered_kv.steps import Steps, drain


def test_drain_runs_every_step_and_returns_the_result():
    ran: list[int] = []

    def call() -> Steps[str]:
        for i in range(3):
            ran.append(i)
            yield
        return "done"

    assert drain(call()) == "done" and ran == [0, 1, 2]
