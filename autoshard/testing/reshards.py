"""A reshard as apply writes it, compiled: the yardstick the cost stage's reshard prices
are checked against (``tests/unit/cost/test_cost.py``, ``tests/unit/cost/test_partitioner.py``,
``benchmarks/reshard_accuracy.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from autoshard.frontend import specs
from autoshard.frontend.specs import Spec
from autoshard.report.hlo_report import hlo_report
from autoshard.target.hardware import Hardware


def compiled_reshard(mesh: Mesh, hw: Hardware, shape, src: Spec, dst: Spec,
                     dtype=jnp.float32) -> list[tuple[str, tuple[str, ...], float]]:
    """(kind, mesh axes, bytes per device) of each collective XLA compiles to take an
    array of ``shape`` from ``src`` to ``dst``, written as apply writes a reshard: a
    result constrained to its spec, read through a constraint to the other."""
    s, d = (NamedSharding(mesh, specs.to_partition_spec(x)) for x in (src, dst))
    constrain = jax.lax.with_sharding_constraint
    fn = jax.jit(lambda x: constrain(constrain(x * 2, s), d) * 3, in_shardings=s,
                 out_shardings=d)
    report = hlo_report(fn.lower(jax.ShapeDtypeStruct(shape, dtype)).compile(), hw, mesh)
    return [(c.kind, c.axes, c.num_bytes) for c in report.collectives for _ in range(c.count)]
