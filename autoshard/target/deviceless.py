"""Meshes of GPUs this machine need not have.

XLA compiles a program for GPUs without one ("deviceless" ahead-of-time compilation):
JAX's CUDA plugin describes a topology of hosts from a ``GpuTargetConfig`` of the GPU
kind (its cores, memory, bandwidth and compute capability), and ``jax.jit`` lowers and
compiles for that topology's devices. ``target_mesh`` builds a mesh over them, so that
``autoshard.plan`` prices the GPU kind (``hardware.default_hardware`` reads its kind and
which axes cross hosts) and ``plan.report``, ``hlo_report`` and ``judge.compare`` read
XLA:GPU's program. Nothing runs there: numbers come from the compiler, not from a GPU.
The CPU backend stays JAX's default in the same process.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Sequence
from importlib import resources

import numpy as np

from autoshard.errors import MeshError

DEVICES_PER_HOST = 8
TARGET_CONFIGS = "configs"   # package folder of ``<kind>.txtpb``, one GpuTargetConfig each
SKIP_CUDA_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


def allow_deviceless_cuda() -> None:
    """Let JAX's CUDA plugin start on a machine without an NVIDIA driver.

    The plugin checks the CUDA libraries against the driver when JAX's backend starts and,
    finding none, does not register, so no GPU topology can be described later in the
    process. Where no driver is present that check can only fail; skipping it lets the
    plugin describe topologies while JAX still runs on the CPU. Called when autoshard is
    imported, before JAX's backend starts; a machine with a driver keeps the check."""
    if not os.path.exists("/proc/driver/nvidia/version"):
        os.environ.setdefault(SKIP_CUDA_CHECK, "1")


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (``jax[cuda12]``) is installed, GPU or not."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:   # no jax_plugins package at all
        return False


def target_kinds() -> tuple[str, ...]:
    """The GPU kinds ``target_mesh`` can compile for, e.g. ``("a100", "h100", "h200")``."""
    folder = resources.files("autoshard.target") / TARGET_CONFIGS
    return tuple(sorted(p.name.removesuffix(".txtpb") for p in folder.iterdir()
                        if p.name.endswith(".txtpb")))


def target_config(kind: str) -> str:
    """The ``GpuTargetConfig`` text proto of GPU ``kind`` (one of ``target_kinds()``)."""
    kinds = target_kinds()
    if kind.lower() not in kinds:
        raise MeshError(f"no target config for GPU kind {kind!r}; kinds: {', '.join(kinds)}")
    folder = resources.files("autoshard.target") / TARGET_CONFIGS
    return (folder / f"{kind.lower()}.txtpb").read_text()


def topology_name(num_devices: int, devices_per_host: int) -> str:
    """JAX's CUDA topology of ``num_devices`` GPUs, ``slices x hosts x GPUs per host``."""
    if num_devices <= devices_per_host:
        return f"1x1x{num_devices}"
    if num_devices % devices_per_host:
        raise MeshError(f"{num_devices} GPUs do not fill hosts of {devices_per_host}; pass "
                        "devices_per_host= that divides the mesh")
    return f"1x{num_devices // devices_per_host}x{devices_per_host}"


def target_devices(kind: str, num_devices: int, devices_per_host: int = DEVICES_PER_HOST):
    """``num_devices`` deviceless GPUs of ``kind`` on hosts of ``devices_per_host``, in
    host order (the devices of host 0 first)."""
    from jax.experimental import topologies
    config = target_config(kind)
    topology = topology_name(num_devices, devices_per_host)
    try:
        described = topologies.get_topology_desc(platform="cuda", target_config=config,
                                                 topology=topology)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise MeshError(
            f"cannot describe {topology} {kind} GPUs: compiling for GPUs without one needs "
            f"JAX's CUDA plugin (pip install \"autoshard[cuda]\"), started with {SKIP_CUDA_CHECK}"
            "=1 where the machine has no NVIDIA driver (autoshard sets it when imported "
            f"before JAX's backend starts). JAX said: {e}") from e
    return list(described.devices)


def target_mesh(kind: str, axis_shapes: Sequence[int], axis_names: Sequence[str], *,
                devices_per_host: int = DEVICES_PER_HOST):
    """A mesh of deviceless GPUs of ``kind``: plans made on it are priced for that GPU and
    compiled by XLA:GPU, on a machine with no GPU. The last axes fill a host first, so
    with hosts of 8 an ``(8, 8)`` mesh's first axis crosses hosts and its second does not.

    Example::

        mesh = autoshard.target_mesh("h100", (8, 8), ("data", "model"))   # 8 hosts of 8
        plan = autoshard.plan(train_step, *abstract_args, mesh=mesh)
        print(plan.report(*abstract_args))      # XLA:GPU's collectives and memory
    """
    from autoshard.frontend import validate
    from autoshard.target.mesh import make_mesh
    axis_shapes, axis_names = validate.mesh_arguments(axis_shapes, axis_names)
    devices = target_devices(kind, math.prod(axis_shapes), devices_per_host)
    return make_mesh(axis_shapes, axis_names, devices=np.asarray(devices).ravel().tolist())
