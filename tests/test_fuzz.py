"""Random programs (autoshard.testing.fuzz): each plans, runs and matches jax.jit of the
unsharded function; a clean error only where the input has no plan."""

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from autoshard.testing import fuzz

PROGRAMS = 300


@pytest.mark.slow
def test_random_programs_plan_run_and_match_one_device():
    outcomes = []

    @settings(max_examples=PROGRAMS, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one_program(data):
        case = fuzz.generate(fuzz.HypothesisDraw(data))
        outcome = fuzz.check(case)
        note(case.reproducer())
        outcomes.append(outcome)
        assert not outcome.failed, f"{outcome.kind}: {outcome.detail}"

    one_program()
    assert len(outcomes) >= PROGRAMS
    # the fuzzer exercises the planner: most plans split something; the clean errors are
    # budgets below what the arguments need at their most split, and a few tight budgets
    # that the unsplit program exceeds too
    assert sum(o.splits for o in outcomes) >= PROGRAMS // 3
    assert all(o.kind in ("ok", "infeasible", "refused") for o in outcomes)
    assert sum(o.kind == "refused" for o in outcomes) <= PROGRAMS // 50
