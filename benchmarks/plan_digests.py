"""Plan digests: a line per program with its plan's hash, step seconds and bytes per device.

A refactor that must not change behaviour is checked by running this in two checkouts and
comparing the output byte for byte: the zoo's models (tiny), the plain-JAX cases of
``autoshard.testing.plain`` and the programs of ``autoshard.testing.programs``, each
planned on a 2x4 mesh of slowed H100s without the cache. Older checkouts, from before the
package took its layered tree, are read too (their zoo and plan hash lived elsewhere).

Run: PYTHONPATH=<checkout> python benchmarks/plan_digests.py > digests.txt
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import autoshard  # noqa: E402
from autoshard.testing import plain, programs  # noqa: E402

try:
    from autoshard.planning.fingerprint import plan_hash
    from autoshard.zoo import models
except ImportError:   # a checkout from before the layered tree
    from autoshard import models
    from autoshard.distributed import plan_hash


def cases():
    for name in models.names():
        case = models.train_case(name, "tiny")
        yield f"zoo:{name}", case.train_step, case.args
    for make in (plain.lm, plain.lm_clipped, plain.moe, plain.cnn):
        case = make()
        yield f"plain:{make.__name__}", case.train_step, case.args
    for program in programs.all_programs():
        yield f"program:{program.name}", program.fn, program.args


def main():
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    hardware = autoshard.H100.slowed(1000)
    for name, fn, args in cases():
        plan = autoshard.plan(fn, *args, mesh=mesh, hardware=hardware, cache=False,
                              progress=False)
        print(name, plan_hash(plan), f"{plan.cost.total_s:.9g}",
              f"{plan.cost.memory_bytes:.9g}", flush=True)


if __name__ == "__main__":
    main()
