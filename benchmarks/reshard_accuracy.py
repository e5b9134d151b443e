"""Reshards as the planner prices them against what XLA compiles.

For each mesh and array rank: every pair of specs (each mesh axis on one dim or none, in
every order on a dim), or a seeded sample of --sample pairs where there are more, of an
f32 array whose dims every axis divides. Each pair is compiled as apply writes a reshard
(a result constrained to its spec, read through a constraint to the other) and read with
``hlo_report``; the planner's collectives come from ``cost.reshard_collectives``. A pair
matches when both hold the same collectives: kind, mesh axes and bytes per device.

Prints per mesh and rank the pairs tried and those that differ, then the first --show
that differ, each with both lists.

Run: python benchmarks/reshard_accuracy.py [--meshes 2x4,8x2,4x4,2x2x2] [--ranks 2,3]
                                           [--sample 400] [--show 5]
"""

import argparse
import collections
import itertools
import math
import os
import random

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=16").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autoshard  # noqa: E402
from autoshard.cost import reshard_collectives  # noqa: E402
from autoshard.frontend import specs  # noqa: E402
from autoshard.runtime import cli
from autoshard.testing.reshards import compiled_reshard  # noqa: E402

AXIS_NAMES = ("x", "y", "z")


def collectives(found) -> collections.Counter:
    return collections.Counter((kind, tuple(sorted(axes)), int(num_bytes))
                               for kind, axes, num_bytes in found)


def compiled(mesh, hw, shape, src, dst) -> collections.Counter:
    return collectives(compiled_reshard(mesh, hw, shape, src, dst))


def predicted(hw, sizes, shape, src, dst) -> collections.Counter:
    return collectives((c.kind, c.axes, c.num_bytes)
                       for c in reshard_collectives(shape, jnp.float32, src, dst, sizes, hw))


def run(mesh_name: str, rank: int, sample: int, show: int) -> None:
    shape_of_mesh = tuple(int(n) for n in mesh_name.split("x"))
    names = AXIS_NAMES[:len(shape_of_mesh)]
    mesh = autoshard.make_mesh(shape_of_mesh, names,
                               devices=jax.devices()[:math.prod(shape_of_mesh)])
    hw, sizes = cli.cpu_hardware(mesh), dict(zip(names, shape_of_mesh))
    devices = math.prod(shape_of_mesh)
    shape = tuple(devices * 2 ** k for k in range(rank))
    pairs = list(itertools.permutations(specs.enumerate_specs(shape, sizes, every_order=True),
                                        2))
    if len(pairs) > sample:
        random.Random(0).shuffle(pairs)
        pairs = pairs[:sample]
    apart = []
    for src, dst in pairs:
        got, want = predicted(hw, sizes, shape, src, dst), compiled(mesh, hw, shape, src, dst)
        if got != want:
            apart.append((src, dst, got, want))
    print(f"{mesh_name:>6}  rank {rank}  {len(pairs):5d} pairs  {len(apart):4d} differ",
          flush=True)
    for src, dst, got, want in apart[:show]:
        print(f"    {specs.spec_str(src)} -> {specs.spec_str(dst)}\n"
              f"      planner {dict(got)}\n      compiled {dict(want)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="2x4,8x2,4x4,2x2x2")
    parser.add_argument("--ranks", default="2,3")
    parser.add_argument("--sample", type=int, default=400)
    parser.add_argument("--show", type=int, default=5)
    args = parser.parse_args()
    for mesh_name in args.meshes.split(","):
        for rank in (int(r) for r in args.ranks.split(",")):
            run(mesh_name, rank, args.sample, args.show)


if __name__ == "__main__":
    main()
