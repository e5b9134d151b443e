"""Random programs (autoshard.testing.fuzz): each plans, runs and matches jax.jit of the
unsharded function; a clean error only where the input has no plan."""

import json
import subprocess
import sys

import distributed_runs as runs
import fuzz_campaign
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.testing import fuzz

PROGRAMS = 300
CAMPAIGN_TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """The outcomes of PROGRAMS generated programs (tests/integration/fuzz_campaign.py),
    checked in a process of their own: one that XLA aborts fails here with its reproducer
    rather than taking the test worker down."""
    log = tmp_path_factory.mktemp("fuzz") / "campaign.log"
    run = subprocess.run([sys.executable, fuzz_campaign.__file__, str(PROGRAMS), str(log)],
                         capture_output=True, text=True, timeout=CAMPAIGN_TIMEOUT_S,
                         env=runs.child_env(), cwd=runs.ROOT)
    lines = log.read_text().splitlines() if log.exists() else []
    outcomes = [fuzz.Outcome(**json.loads(line[len(fuzz_campaign.OUTCOME):]))
                for line in lines if line.startswith(fuzz_campaign.OUTCOME)]
    if run.returncode:
        last = lines[-1] if lines else ""
        killed = (f"killed while checking:\n{json.loads(last[len(fuzz_campaign.PROGRAM):])}"
                  if last.startswith(fuzz_campaign.PROGRAM) else "")
        pytest.fail(f"the campaign exited {run.returncode} after {len(outcomes)} programs; "
                    f"{killed}\n{run.stdout[-6000:]}\n{run.stderr[-6000:]}")
    return outcomes


@pytest.mark.slow
def test_random_programs_plan_run_and_match_one_device(campaign):
    outcomes = campaign
    assert len(outcomes) >= PROGRAMS
    # the fuzzer exercises the planner: most plans split something; the clean errors are
    # budgets below what the arguments need at their most split, and a few tight budgets
    # that the unsplit program exceeds too
    assert sum(o.splits for o in outcomes) >= PROGRAMS // 3
    assert all(o.kind in ("ok", "infeasible", "refused", "over_budget") for o in outcomes)
    assert sum(o.kind == "refused" for o in outcomes) <= PROGRAMS // 50


@pytest.mark.slow
def test_tight_budgets_hold_once_compiled(campaign):
    # the memory model still misses some temporaries XLA keeps (top_k's, grouped
    # convolutions', loop carries copied): which programs cross their budget depends on
    # XLA's buffer assignment, so the bound is on how many and by how much
    over = [o for o in campaign if o.kind == "over_budget"]
    print(f"{len(over)} of {len(campaign)} over budget, by",
          ", ".join(f"{o.overrun:.1%}" for o in over) or "none")
    assert len(over) <= PROGRAMS // 50, [o.detail for o in over]
    assert all(o.overrun <= 0.25 for o in over), [o.detail for o in over]


def halved(x: np.ndarray, at: int) -> np.ndarray:
    y = x.copy()
    y.flat[at] = y.flat[at] / 2
    return y


@pytest.mark.parametrize("dtype,low", [("float32", False), ("bfloat16", True),
                                       ("float32", True)])
def test_an_element_halved_is_wrong_on_every_precision_path(dtype, low):
    # an output of standard normal values, one element of a twentieth of the largest
    # halved: caught whether the output is f32, bf16, or f32 computed from bf16
    want = np.random.default_rng(0).standard_normal(64).astype(jnp.dtype(dtype))
    at = int(np.argmin(np.abs(np.abs(want.astype(np.float64))
                              - np.abs(want.astype(np.float64)).max() / 20)))
    assert fuzz.compare((halved(want, at),), (want,), low_outputs=(low,)).kind == "wrong"
    assert fuzz.compare((want,), (want,), low_outputs=(low,)).kind == "ok"


def test_an_output_not_computed_from_bf16_keeps_f32_tolerance():
    # a program with a bf16 input elsewhere: its f32 output off by 1e-3 is wrong
    want = np.random.default_rng(1).standard_normal(16).astype(np.float32)
    got = want * np.float32(1.001)
    assert fuzz.compare((got, want), (want, want), low_outputs=(False, True)).kind == "wrong"
    assert fuzz.compare((want, got), (want, want), low_outputs=(False, True)).kind == "ok"


def test_the_generator_marks_outputs_computed_from_bf16():
    b = fuzz.Builder(fuzz.RandomDraw(0), differentiable=False)
    x, y = b.arg((4,), "bfloat16"), b.arg((4,), "float32")
    mixed = b.emit(f"{x.name}.astype(jnp.float32) + {y.name}", (4,), "float32")
    plain = b.emit(f"{y.name} * 2", (4,), "float32")
    later = b.emit(f"jnp.sin({mixed.name})", (4,), "float32")
    assert (mixed.low, plain.low, later.low) == (True, False, True)


def test_a_plan_compiled_over_its_tight_budget_fails(monkeypatch):
    # the compiled program's memory is read for every tight budget: inflated past the
    # budget, the same plan is a failure of its own kind
    tight = (c for c in (fuzz.generate(fuzz.RandomDraw(seed)) for seed in range(200))
             if c.budget == "tight" and not c.features)
    case = next(c for c in tight if fuzz.check(c).kind == "ok")
    compile_with_buffer_bytes = fuzz.compile_with_buffer_bytes

    def inflated(lowered):
        compiled, live, allocated = compile_with_buffer_bytes(lowered)
        return compiled, live, allocated + 10 ** 9
    monkeypatch.setattr(fuzz, "compile_with_buffer_bytes", inflated)
    outcome = fuzz.check(case)
    assert outcome.kind == "over_budget" and outcome.failed


def test_convolutions_and_transforms_are_drawn_often():
    # of 2000 programs, at least 50 each with grouped convolutions, their gradients and
    # FFTs, and with pins and budgets beside them
    cases = [fuzz.generate(fuzz.RandomDraw(seed)) for seed in range(2000)]
    for feature in ("grouped_conv", "strided_conv", "dilated_conv", "conv_grad", "fft"):
        having = [c for c in cases if feature in c.features]
        assert len(having) >= 50, feature
        assert sum(bool(c.pins) for c in having) >= 20, feature
        assert sum(c.budget is not None for c in having) >= 20, feature
