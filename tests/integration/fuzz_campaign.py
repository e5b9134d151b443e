"""A hypothesis campaign of random programs (autoshard.testing.fuzz), run as a script in
its own process by tests/integration/test_fuzz.py.

    python tests/integration/fuzz_campaign.py PROGRAMS LOG

Each program's reproducer is written to LOG before it is checked, and its outcome (a JSON
line) after, so a program that kills the process (XLA aborting while it compiles) is named
by the log's last reproducer. A crash, a wrong number or a hang stops the campaign there,
shrunk to its smallest program.
"""

import dataclasses
import json
import os
import sys

PROGRAM, OUTCOME = "program ", "outcome "


def campaign(programs: int, log) -> None:
    from hypothesis import HealthCheck, given, note, settings
    from hypothesis import strategies as st

    from autoshard.testing import fuzz

    @settings(max_examples=programs, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one_program(data):
        case = fuzz.generate(fuzz.HypothesisDraw(data))
        log.write(PROGRAM + json.dumps(case.reproducer()) + "\n")
        log.flush()
        outcome = fuzz.check(case)
        note(case.reproducer())
        log.write(OUTCOME + json.dumps(dataclasses.asdict(outcome)) + "\n")
        log.flush()
        assert not outcome.failed or outcome.kind == "over_budget", \
            f"{outcome.kind}: {outcome.detail}"

    one_program()


if __name__ == "__main__":
    # 8 simulated CPU devices, before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    with open(sys.argv[2], "w") as log:
        campaign(int(sys.argv[1]), log)
