"""Plan and run a small transformer LM train step on 8 simulated CPU devices.

Prints the plan table, the predicted cost beside the compiled program's figures, and a
numerics check of the sharded step against one device.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import autoshard  # noqa: E402
from autoshard.testing import programs  # noqa: E402


def main():
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    program = programs.transformer_train_step(batch=16, seq=32, d_model=128, d_ff=512)
    plan = autoshard.plan(program.fn, *program.args, mesh=mesh)
    plan.summary()
    print(plan.explain("params['layers'][0]['wq']"))
    print("\npredicted vs compiled (per device):")
    print(plan.report(*program.args))
    expected = jax.jit(program.fn)(*program.args)
    got = plan.jit()(*program.args)
    worst = max(float(np.max(np.abs(np.asarray(g) - np.asarray(e))))
                for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)))
    ok = all(np.allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=program.atol)
             for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)))
    print(f"\nnumerics vs one device: max |diff| = {worst:.3g} "
          f"(rtol 1e-5, atol {program.atol}) -> {'OK' if ok else 'MISMATCH'}")
    print(f"loss: {float(got[-1]):.5f}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
