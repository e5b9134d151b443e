"""Price what XLA actually compiled: FLOPs, HBM bytes, collectives and memory per device.

``hlo_report(compiled, hardware, mesh)`` reads the SPMD-partitioned optimized HLO text of a
``jax.stages.Compiled`` and its ``memory_analysis()``, and prices it with the same
functions (``autoshard.target.hardware``) the planner's cost model uses, so a plan is judged by
the program XLA built rather than by the model that chose it.

Example::

    compiled = jax.jit(f, in_shardings=..., out_shardings=...).lower(*args).compile()
    report = autoshard.report.hlo_report.hlo_report(compiled, autoshard.target.hardware.H100, mesh)
    print(report.summary())

The HLO is per device (one SPMD partition), so every number in the report is per device.
Ops inside ``while`` bodies are multiplied by the loop's ``known_trip_count``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from autoshard.target.hardware import Hardware, collective_seconds

__all__ = [
    "CompiledCollective", "Computation", "HloModule", "Instruction", "Report", "Shape",
    "hlo_report", "parse_hlo", "parse_replica_groups", "report_from_hlo_text",
]

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")

# Bits per element of each HLO primitive type (tuple/token/opaque have no elements).
_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "token": 0, "opaque": 0,
}

# Ops that only move references around: they touch no HBM of their own.
_PLUMBING = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                       "after-all", "add-dependency", "opt-barrier"})


# --------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    """An HLO shape: an array (``dtype`` and ``dims``) or a tuple of ``elements``."""

    dtype: str = "tuple"
    dims: tuple[int, ...] = ()
    elements: tuple[Shape, ...] = ()

    @property
    def is_tuple(self) -> bool:
        return self.dtype == "tuple"

    @property
    def num_elements(self) -> int:
        """Elements of an array shape (summed over a tuple's leaves)."""
        if self.is_tuple:
            return sum(e.num_elements for e in self.elements)
        return math.prod(self.dims)

    @property
    def num_bytes(self) -> int:
        """Bytes of the buffer(s) this shape describes (summed over a tuple's leaves)."""
        if self.is_tuple:
            return sum(e.num_bytes for e in self.elements)
        bits = _DTYPE_BITS.get(self.dtype)
        if bits is None:  # f8e4m3fn, f8e5m2, ... all 8-bit
            bits = 8 if self.dtype.startswith("f8") else 32
        return (math.prod(self.dims) * bits + 7) // 8


def _parse_shape(text: str) -> Shape:
    """Parse ``f32[64,256]{1,0}``, ``(s32[], f32[8]{0})`` or ``token[]``."""
    text = text.strip()
    if text.startswith("("):
        inner = text[1:_matching(text, 0)]
        return Shape(elements=tuple(_parse_shape(p) for p in _split_top(inner) if p.strip()))
    m = re.match(r"([a-z][a-z0-9]*)\[([^\]]*)\]", text)
    if not m:
        return Shape(dtype=text.split("{")[0] or "opaque")
    dims = tuple(int(d.replace("<=", "")) for d in m.group(2).split(",") if d.strip())
    return Shape(dtype=m.group(1), dims=dims)


# --------------------------------------------------------------------------- text scanning

_OPEN = {"(": ")", "[": "]", "{": "}"}


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing ``text[start]``, skipping quoted strings."""
    depth, i, in_str = 0, start, False
    while i < len(text):
        ch = text[i]
        if in_str:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in _OPEN:
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced brackets in HLO text: {text[start:start + 80]!r}")


def _split_top(text: str) -> list[str]:
    """Split at commas that are outside brackets and quotes."""
    parts, depth, start, in_str, i = [], 0, 0, False, 0
    while i < len(text):
        ch = text[i]
        if in_str:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in _OPEN:
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_attrs(text: str) -> dict[str, str]:
    """``a=1, b={...}`` -> {"a": "1", "b": "{...}"}; a mesh-form ``device_ids=`` stays
    inside its ``replica_groups`` value."""
    attrs: dict[str, str] = {}
    last = None
    for part in _split_top(text):
        key, eq, value = part.partition("=")
        if last == "replica_groups" and key.strip() == "device_ids" and "{" not in attrs[last]:
            attrs[last] += ", " + part
            continue
        if eq:
            last = key.strip()
            attrs[last] = value.strip()
    return attrs


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"-?\d+", text)]


def _brace_lists(text: str) -> list[list[int]]:
    """``{{0,1},{2,3}}`` -> [[0, 1], [2, 3]]."""
    return [_ints(g) for g in re.findall(r"\{([^{}]*)\}", text.strip()[1:-1])]


# --------------------------------------------------------------------------- HLO structure


@dataclasses.dataclass
class Instruction:
    """One HLO instruction: ``name = shape opcode(operands), attrs``."""

    name: str
    opcode: str
    shape: Shape
    operands: tuple[str, ...]
    attrs: dict[str, str]
    is_root: bool = False
    parameter_number: int | None = None

    def called(self, *keys: str) -> list[str]:
        """Names of computations this instruction calls through ``keys`` (e.g. ``calls``)."""
        names: list[str] = []
        for key in keys or ("calls", "to_apply", "body", "condition", "branch_computations",
                            "true_computation", "false_computation"):
            value = self.attrs.get(key, "")
            names += [n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", value.strip("{}"))]
        return names

    def backend_config(self) -> dict:
        """The ``backend_config`` JSON as a dict ({} when absent or not JSON)."""
        raw = self.attrs.get("backend_config", "")
        if raw.startswith('"'):
            raw = json.loads(raw)
        try:
            value = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, TypeError):
            return {}
        return value if isinstance(value, dict) else {}


@dataclasses.dataclass
class Computation:
    """A named list of instructions; ``by_name`` indexes them."""

    name: str
    instructions: list[Instruction]
    is_entry: bool = False

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.instructions}
        self._users: dict[str, list[Instruction]] | None = None

    @property
    def root(self) -> Instruction:
        return next((i for i in self.instructions if i.is_root), self.instructions[-1])

    def users(self, name: str) -> list[Instruction]:
        """Instructions of this computation that read ``name``."""
        if self._users is None:
            self._users = {}
            for inst in self.instructions:
                for op in set(inst.operands):
                    self._users.setdefault(op, []).append(inst)
        return self._users.get(name, [])

    def parameter(self, number: int) -> Instruction | None:
        return next((i for i in self.instructions if i.parameter_number == number), None)


@dataclasses.dataclass
class HloModule:
    """A parsed HLO module: its computations by name and which one is the entry."""

    name: str
    computations: dict[str, Computation]
    entry_name: str
    num_partitions: int = 1
    replica_count: int = 1

    @property
    def entry(self) -> Computation:
        return self.computations[self.entry_name]

    @property
    def num_devices(self) -> int:
        """Devices one program runs on (partitions x replicas)."""
        return self.num_partitions * self.replica_count


_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*?)?\s*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTRUCTION.match(line)
    if not m:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3).strip()
    if not rest.startswith("(") and " " not in rest:
        return None
    end = _matching(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
    shape, rest = _parse_shape(rest[:end]), rest[end:].strip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _matching(rest, op.end() - 1)
    args, tail = rest[op.end():close], rest[close + 1:].lstrip(", ")
    opcode = op.group(1)
    operands: tuple[str, ...] = ()
    parameter_number = None
    if opcode == "parameter":
        parameter_number = int(args)
    elif opcode != "constant":
        operands = tuple(a.split()[-1].lstrip("%") for a in _split_top(args))
    return Instruction(name, opcode, shape, operands, _parse_attrs(tail), is_root, parameter_number)


def parse_hlo(text: str) -> HloModule:
    """Parse HLO module text (``compiled.as_text()``) into an :class:`HloModule`."""
    header = re.search(r"^HloModule\s+([^\s,]+)(.*)$", text, re.M)
    name, flags = (header.group(1), header.group(2)) if header else ("module", "")
    computations: dict[str, Computation] = {}
    entry_name, current, body = None, None, []
    for raw in text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", raw).rstrip()
        if current is None:
            m = _COMP_HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current, body = (m.group(2), bool(m.group(1))), []
            continue
        if line.strip().startswith("}"):
            computations[current[0]] = Computation(current[0], body, current[1])
            entry_name = current[0] if current[1] else entry_name
            current = None
            continue
        inst = _parse_instruction(line)
        if inst is not None:
            body.append(inst)
    if not computations:
        raise ValueError("no HLO computations found in text")
    entry_name = entry_name or list(computations)[-1]
    partitions = re.search(r"num_partitions=(\d+)", flags)
    replicas = re.search(r"replica_count=(\d+)", flags)
    return HloModule(name, computations, entry_name,
                     int(partitions.group(1)) if partitions else 1,
                     int(replicas.group(1)) if replicas else 1)


# --------------------------------------------------------------------------- replica groups


def _iota(reshape_dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape_dims)).reshape(tuple(reshape_dims))
    return ids.transpose(tuple(perm)) if perm else ids


def _iota_groups(text: str) -> list[list[int]]:
    """``[4,2]<=[2,4]T(1,0)``: iota over [2,4], transposed by (1,0), reshaped to [4,2]."""
    m = re.match(r"\[([\d,\s]*)\]\s*<=\s*\[([\d,\s]*)\](?:\s*T\(([\d,\s]*)\))?", text)
    shape, dims = _ints(m.group(1)), _ints(m.group(2))
    perm = _ints(m.group(3)) if m.group(3) else None
    return _iota(dims, perm).reshape(-1, shape[-1]).tolist()


def _mesh_device_array(text: str, sizes: list[int]) -> np.ndarray:
    """Device ids of a mesh form: iota, or ``device_ids=([2,4]T(1,0))`` / a flat list."""
    m = re.search(r"device_ids=\((.*)\)\s*\{", text)
    if not m:
        return np.arange(math.prod(sizes)).reshape(sizes)
    spec = m.group(1).strip()
    iota = re.match(r"\[([\d,\s]*)\](?:\s*T\(([\d,\s]*)\))?$", spec)
    if iota and "<=" not in spec:
        ids = _iota(_ints(iota.group(1)), _ints(iota.group(2)) if iota.group(2) else None)
    elif "<=" in spec:
        ids = np.asarray(_iota_groups(spec))
    else:
        ids = np.asarray(_ints(spec))
    return ids.reshape(sizes)


def _split_mesh_dim(full: int, refs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Reshape one mesh dim of size ``full`` for sub-axis refs ``[(pre_size, size)]``.

    Returns the reshape dims and, per ref in the given order, which of them it groups.
    """
    order = sorted(range(len(refs)), key=lambda k: refs[k][0])
    dims, grouped, prefix = [], [0] * len(refs), 1
    for k in order:
        pre, size = refs[k]
        if pre != prefix:
            dims.append(pre // prefix)
            prefix = pre
        grouped[k] = len(dims)
        dims.append(size)
        prefix *= size
    if prefix != full:
        dims.append(full // prefix)
    return dims, grouped


def _mesh_groups(text: str) -> list[list[int]]:
    """``mesh['a'=2,'b'=4] {'b'}`` (optionally ``, device_ids=(...)``, sub-axes ``'b':(1)2``)."""
    axes_text = text[text.index("[") + 1:_matching(text, text.index("["))]
    axes = [(n, int(s)) for n, s in re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", axes_text)]
    names, sizes = [n for n, _ in axes], [s for _, s in axes]
    device_array = _mesh_device_array(text, sizes)
    group_text = text[text.rindex("{") + 1:text.rindex("}")]
    refs = [(n, int(p) if p else None, int(s) if s else None) for n, p, s in
            re.findall(r"'?([^':,\s()]+)'?(?::\((\d+)\)(\d+))?", group_text)]
    reshape, grouped_dims = [], []
    for name, full in zip(names, sizes):
        mine = [(k, r) for k, r in enumerate(refs) if r[0] == name]
        offset = len(reshape)
        if not mine:
            reshape.append(full)
            continue
        dims, grouped = _split_mesh_dim(full, [(p or 1, s or full) for _, (_, p, s) in mine])
        reshape += dims
        grouped_dims += [(k, offset + g) for (k, _), g in zip(mine, grouped)]
    grouped_order = [d for _, d in sorted(grouped_dims)]
    perm = [d for d in range(len(reshape)) if d not in grouped_order] + grouped_order
    group_size = math.prod(reshape[d] for d in grouped_order)
    return device_array.reshape(reshape).transpose(perm).reshape(-1, group_size).tolist()


def parse_replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """Device-id groups of any replica-group spelling.

    ``{{0,1},{2,3}}`` (explicit), ``[4,2]<=[2,4]T(1,0)`` (iota), ``mesh['a'=2,'b'=4] {'b'}``
    (mesh axes), and ``{}`` meaning one group of all ``num_devices``.
    """
    text = text.strip()
    if text.startswith("mesh"):
        return _mesh_groups(text)
    if text.startswith("["):
        return _iota_groups(text)
    return (_brace_lists(text) if text else []) or [list(range(num_devices))]


def _axes_of(device_sets: Sequence[Sequence[int]], mesh) -> tuple[str, ...]:
    """Mesh axes along which members of any set differ (partition i = ``mesh.devices.flat[i]``)."""
    if mesh is None:
        return ()
    shape = mesh.devices.shape
    if any(d < 0 or d >= math.prod(shape) for s in device_sets for d in s):
        return ()
    varying = set()
    for members in device_sets:
        coords = np.array(np.unravel_index(np.asarray(list(members), dtype=int), shape))
        varying |= {a for a in range(len(shape)) if len(set(coords[a].tolist())) > 1}
    return tuple(name for a, name in enumerate(mesh.axis_names) if a in varying)


# --------------------------------------------------------------------------- flops


def _operand_shape(comp: Computation, inst: Instruction, k: int) -> Shape | None:
    op = comp.by_name.get(inst.operands[k]) if k < len(inst.operands) else None
    return op.shape if op else None


def _dot_flops(comp: Computation, inst: Instruction, contracting: Sequence[int]) -> int:
    lhs = _operand_shape(comp, inst, 0)
    result = inst.shape.elements[0] if inst.shape.is_tuple else inst.shape
    if lhs is None or lhs.is_tuple:
        return 0
    return 2 * result.num_elements * math.prod(lhs.dims[c] for c in contracting)


def _conv_flops(comp: Computation, inst: Instruction) -> int:
    """2 * output elements * kernel spatial * input features per group (from the kernel),
    of the forward convolution. A cuDNN backward call keeps the forward's window and
    dim labels: its kernel and forward output are where the pass puts them
    (``_conv_roles``)."""
    labels = inst.attrs.get("dim_labels", "")
    kernel, output = _conv_roles(comp, inst)
    if kernel is None or output is None or "_" not in labels:
        return 0
    kernel_labels = labels.split("_")[1].split("->")[0]
    spatial = math.prod(kernel.dims[i] for i, c in enumerate(kernel_labels) if c.isdigit())
    in_features = kernel.dims[kernel_labels.index("i")]
    return 2 * output.num_elements * spatial * in_features


def _conv_roles(comp: Computation, inst: Instruction) -> tuple[Shape | None, Shape | None]:
    """(kernel, forward output) of a convolution: operand 1 and the result, save in
    cuDNN's backward calls (XLA:GPU), which take (input, output gradient) and write the
    kernel's gradient, or take (output gradient, kernel) and write the input's."""
    result = inst.shape.elements[0] if inst.shape.is_tuple else inst.shape
    target = inst.attrs.get("custom_call_target", "")
    if "BackwardFilter" in target:
        return result, _operand_shape(comp, inst, 1)
    if "BackwardInput" in target:
        return _operand_shape(comp, inst, 1), _operand_shape(comp, inst, 0)
    return _operand_shape(comp, inst, 1), result


def _gemm_flops(comp: Computation, inst: Instruction) -> int:
    """cuBLAS/cuBLASLt custom calls carry dot dimension numbers in their backend config."""
    config = inst.backend_config()
    gemm = config.get("gemm_backend_config", config)
    numbers = gemm.get("dot_dimension_numbers")
    if not numbers:
        return 0
    return _dot_flops(comp, inst, [int(c) for c in numbers.get("lhs_contracting_dimensions", [])])


def _own_flops(comp: Computation, inst: Instruction) -> int:
    if inst.opcode == "dot":
        return _dot_flops(comp, inst, _ints(inst.attrs.get("lhs_contracting_dims", "")))
    if inst.opcode == "convolution":
        return _conv_flops(comp, inst)
    if inst.opcode == "custom-call":
        target = inst.attrs.get("custom_call_target", "")
        if "conv" in target and "dim_labels" in inst.attrs:
            return _conv_flops(comp, inst)
        if "gemm" in target or "matmul" in target:
            return _gemm_flops(comp, inst)
    return 0


def _flops(module: HloModule, comp: Computation, inst: Instruction) -> int:
    """Dot/convolution FLOPs of one op, including those in computations it calls."""
    total = _own_flops(comp, inst)
    for name in inst.called("calls", "to_apply"):
        called = module.computations.get(name)
        if called is not None:
            total += sum(_flops(module, called, i) for i in called.instructions)
    return total


# --------------------------------------------------------------------------- walking


def _trip_count(inst: Instruction) -> int | None:
    n = inst.backend_config().get("known_trip_count", {}).get("n")
    return int(n) if n is not None else None


def _walk(module: HloModule, comp: Computation, multiplier: int,
          warnings: list[str]) -> Iterator[tuple[Computation, Instruction, int]]:
    """Top-level ops of ``comp`` and of the loop/call/branch bodies it runs, with how
    many times each runs (every branch of a conditional counts, an upper bound)."""
    for inst in comp.instructions:
        if inst.opcode == "while":
            trips = _trip_count(inst)
            if trips is None:
                warnings.append(f"while {inst.name} has no known_trip_count; counted once")
            for body in inst.called("body"):
                body_comp = module.computations[body]
                yield from _walk(module, body_comp, multiplier * (trips or 1), warnings)
        elif inst.opcode in ("call", "conditional"):
            for name in inst.called("to_apply", "branch_computations", "true_computation",
                                    "false_computation"):
                yield from _walk(module, module.computations[name], multiplier, warnings)
        else:
            yield comp, inst, multiplier


_NARROW_FLOATS = ("bf16", "f16")


def _widened_from(comp: Computation, inst: Instruction) -> tuple[str, str] | None:
    """(program dtype, compiled dtype) when a collective reduces a float its backend
    widened first (CPU XLA converts bf16 to f32 around an all-reduce): its operand is a
    convert, or a fusion ending in one, from a narrower float."""
    result = _result_shape(inst)
    if result.is_tuple or result.dtype in _NARROW_FLOATS:
        return None
    for name in inst.operands:   # widened before it
        operand = comp.by_name.get(name)
        if (operand is not None and operand.opcode == "convert" and operand.operands
                and operand.operands[0] in comp.by_name):
            source = comp.by_name[operand.operands[0]].shape.dtype
            if source in _NARROW_FLOATS:
                return source, result.dtype
    for user in comp.users(inst.name):   # narrowed after it (the dot ran in f32)
        if user.opcode in ("convert", "fusion") and _converts_to(user, comp) in _NARROW_FLOATS:
            return _result_shape(user).dtype, result.dtype
    return None


def _converts_to(inst: Instruction, comp: Computation) -> str | None:
    """The dtype ``inst`` converts to: a convert, or a fusion wrapping one (CPU)."""
    if inst.opcode == "convert" or "convert" in inst.name:
        return _result_shape(inst).dtype
    return None


def _is_done(inst: Instruction) -> bool:
    return inst.opcode.endswith("-done") or inst.opcode == "async-update"


def _result_shape(inst: Instruction) -> Shape:
    """The value an op produces; for an async start, its output (element 1 of the tuple)."""
    if inst.opcode.endswith("-start") and inst.shape.is_tuple and len(inst.shape.elements) > 1:
        return inst.shape.elements[1]
    return inst.shape


def _bytes(module: HloModule, comp: Computation, inst: Instruction) -> int:
    """HBM bytes an op reads (its operands) and writes (its result).

    Slicing and in-place updates touch only the slice: a dynamic-slice reads what it
    keeps, and a dynamic-update-slice writes its update into the operand's buffer
    (XLA aliases them), e.g. a scan reading one layer's weights from the stack and
    writing one layer's residuals into the stacked ys, once per iteration."""
    if inst.opcode in _PLUMBING or _is_done(inst):
        return 0
    if inst.opcode == "dynamic-slice":
        return 2 * inst.shape.num_bytes
    if inst.opcode == "dynamic-update-slice":
        return 2 * _shape_of(comp, inst.operands[1]).num_bytes
    if inst.opcode == "fusion" and inst.called("calls"):
        return _fusion_bytes(comp, inst, module.computations[inst.called("calls")[0]])
    operands = sum(_shape_of(comp, o).num_bytes for o in inst.operands)
    return operands + _result_shape(inst).num_bytes


def _shape_of(comp: Computation, name: str) -> Shape:
    return comp.by_name[name].shape if name in comp.by_name else Shape(elements=())


def _fusion_bytes(comp: Computation, inst: Instruction, fused: Computation) -> int:
    """A fusion reads each operand whole, or only the slices it takes of it, and writes its
    result, or only the updates of the outputs it updates in place. A loop fusion of ops
    that each read one element per element they compute (``_elementwise_loop``) reads at
    most as many elements of an operand as it computes: a slice or an all-to-all chunk
    cut from an elementwise result reads only what it keeps."""
    root = fused.root
    outputs = ([fused.by_name[o] for o in root.operands if o in fused.by_name]
               if root.opcode == "tuple" else [root])
    in_place, written, computed = set(), 0, 0
    for out in outputs:
        update = _in_place_update(fused, out)
        if update is not None:
            buffer, update_elements = update
            in_place.add(buffer)
            written += update_elements * out.shape.num_bytes // max(out.shape.num_elements, 1)
            computed = max(computed, update_elements)
        else:
            written += out.shape.num_bytes
            computed = max(computed, out.shape.num_elements)
    bounded = _elementwise_loop(inst, fused)
    read = 0
    for k, operand in enumerate(inst.operands):
        param = fused.parameter(k)
        if param is not None and param.name in in_place:
            continue   # the buffer the update is written into: not read
        users = fused.users(param.name) if param is not None else []
        shape = _shape_of(comp, operand)
        if users and all(u.opcode in ("dynamic-slice", "slice") and u.operands[0] == param.name
                         for u in users):
            read += sum(u.shape.num_bytes for u in users)
        elif bounded and shape.num_elements > computed:
            read += shape.num_bytes * computed // shape.num_elements
        else:
            read += shape.num_bytes
    return read + written


# ops that compute each element of their result from one element of each operand, or
# from none (a loop fusion of these reads no more of an operand than it computes)
_ONE_ELEMENT_EACH = frozenset({
    "parameter", "constant", "iota", "broadcast", "bitcast", "reshape", "copy", "transpose",
    "convert", "bitcast-convert", "reduce-precision", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "reverse", "select", "clamp", "compare",
    "tuple", "get-tuple-element", "partition-id", "replica-id",
    "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "power",
    "atan2", "and", "or", "xor", "not", "shift-left", "shift-right-arithmetic",
    "shift-right-logical", "abs", "negate", "sign", "exponential", "exponential-minus-one",
    "log", "log-plus-one", "sqrt", "rsqrt", "cbrt", "tanh", "logistic", "sine", "cosine",
    "tan", "floor", "ceil", "round-nearest-afz", "round-nearest-even", "is-finite",
    "popcnt", "count-leading-zeros", "real", "imag", "complex", "erf", "stochastic-convert"})


def _elementwise_loop(inst: Instruction, fused: Computation) -> bool:
    """Whether ``inst`` is a loop fusion whose every op reads one element of each operand
    per element it computes (no reduction, gather or contraction): XLA emits it as one
    loop over the elements it writes."""
    return (inst.attrs.get("kind") == "kLoop"
            and all(i.opcode in _ONE_ELEMENT_EACH for i in fused.instructions))


def _in_place_update(fused: Computation, out: Instruction) -> tuple[str, int] | None:
    """(the parameter updated, the update's elements) when fusion output ``out`` is a
    dynamic-update-slice of a parameter's buffer, which XLA does in place. CPU XLA updates
    a bf16 buffer in f32, ``convert(dynamic-update-slice(convert(param), update))``,
    rewriting the whole buffer; a backend with bf16 updates writes only the update in
    place, as the program means, and so it is priced."""
    node, widened = out, False
    if node.opcode == "convert" and node.operands[0] in fused.by_name:
        node, widened = fused.by_name[node.operands[0]], True
    if node.opcode != "dynamic-update-slice" or node.operands[0] not in fused.by_name:
        return None
    buffer = fused.by_name[node.operands[0]]
    if widened and buffer.opcode == "convert" and buffer.operands[0] in fused.by_name:
        buffer = fused.by_name[buffer.operands[0]]
        if buffer.shape.dtype != out.shape.dtype:
            return None
    elif widened:
        return None
    if buffer.opcode != "parameter":
        return None
    return buffer.name, _shape_of(fused, node.operands[1]).num_elements


# --------------------------------------------------------------------------- collectives


@dataclasses.dataclass(frozen=True)
class CompiledCollective:
    """One collective op of the compiled program.

    ``num_bytes`` is per device as ``autoshard.target.hardware`` defines it per kind (all-gather:
    result; reduce-scatter: input; all-reduce / all-to-all / collective-permute: the
    buffer). ``seconds`` is one execution; ``count`` is how many times it runs (loop trip
    counts). ``axes`` are the mesh axes the group spans (``()`` when unknown).
    """

    kind: str
    num_bytes: int
    group_size: int
    axes: tuple[str, ...]
    count: int
    seconds: float
    name: str = ""

    @property
    def total_seconds(self) -> float:
        return self.seconds * self.count


def _collective_op(module: HloModule, comp: Computation,
                   inst: Instruction) -> tuple[Computation, Instruction, str] | None:
    """(computation, collective instruction, kind) for a sync, ``-start`` or wrapped op."""
    base = inst.opcode[:-len("-start")] if inst.opcode.endswith("-start") else inst.opcode
    if base in COLLECTIVE_KINDS:
        return comp, inst, base
    if inst.opcode == "async-start":
        for name in inst.called("calls"):
            wrapped = module.computations.get(name)
            for inner in wrapped.instructions if wrapped else ():
                if inner.opcode in COLLECTIVE_KINDS:
                    return wrapped, inner, inner.opcode
    return None


# ops that keep every element of their operand (CPU converts narrow floats to f32 around a
# collective and back: ``collective_widening``)
_SAME_ELEMENTS = ("bitcast", "reshape", "convert")


def _passes_through(fused: Computation) -> bool:
    """Whether a fused computation is one parameter passed through ops that keep every
    element (a wrapped convert)."""
    params = [i for i in fused.instructions if i.opcode == "parameter"]
    return len(params) == 1 and all(i.opcode in _SAME_ELEMENTS for i in fused.instructions
                                    if i.opcode != "parameter")


# ops that move, slice or convert elements without computing on them
_MOVES_ELEMENTS = frozenset({"parameter", "constant", "bitcast", "reshape", "copy",
                             "transpose", "convert", "slice", "dynamic-slice"})


def _rounding_pass(fused: Computation) -> bool:
    """Whether a fused computation only rounds a value to a narrow float and widens it
    back (``convert`` to bf16 or f16, then to a wider float), moving or slicing it on the
    way: what a backend that computes narrow floats wider (CPU) runs where the rounding
    of a dot's or collective's result cannot join an elementwise fusion (between a dot
    and a collective, a loop's stacked slice and a dot). Scalar index arithmetic (a
    slice's offset) aside."""
    rounded = False
    for inst in fused.instructions:
        if inst.opcode == "convert" and inst.shape.dtype not in _NARROW_FLOATS:
            source = fused.by_name.get(inst.operands[0])
            rounded |= source is not None and source.shape.dtype in _NARROW_FLOATS and (
                source.opcode == "convert")
        elif inst.opcode not in _MOVES_ELEMENTS and inst.shape.dims:
            return False
    return rounded


def _only_sliced(module: HloModule, comp: Computation, name: str, num_elements: int,
                 group_size: int) -> bool:
    """Whether every use of ``name`` is a dynamic-slice keeping 1/group_size of it,
    looking through bitcasts, reshapes and converts, async ``-done`` ops and into
    fusions."""
    users = comp.users(name)
    if not users:
        return False
    for user in users:
        if user.opcode == "dynamic-slice" and user.operands[0] == name:
            ok = user.shape.num_elements * group_size == num_elements
        elif user.opcode in _SAME_ELEMENTS or _is_done(user):
            ok = _only_sliced(module, comp, user.name, num_elements, group_size)
        elif user.opcode == "fusion":
            fused = module.computations[user.called("calls")[0]]
            if _passes_through(fused):   # CPU's convert back to the program's dtype
                ok = _only_sliced(module, comp, user.name, num_elements, group_size)
                if not ok:
                    return False
                continue
            params = [fused.parameter(k) for k, o in enumerate(user.operands) if o == name]
            ok = all(p is not None and _only_sliced(module, fused, p.name, num_elements, group_size)
                     for p in params)
        else:
            ok = False
        if not ok:
            return False
    return True


def _collective_bytes(comp: Computation, op: Instruction, kind: str) -> int:
    operands = [comp.by_name[o].shape for o in op.operands if o in comp.by_name]
    if kind == "all-gather" or not operands:
        return _result_shape(op).num_bytes
    return sum(s.num_bytes for s in operands)


def _collectives(module: HloModule, comp: Computation, inst: Instruction, count: int,
                 hardware: Hardware, mesh) -> list[CompiledCollective]:
    """The collectives one op runs: one, or for a combined all-reduce some of whose results
    are only sliced (CPU's reduce-scatters, merged by its combiner with true all-reduces)
    a reduce-scatter of those and an all-reduce of the rest, sharing one latency."""
    found = _collective_op(module, comp, inst)
    if found is None:
        return []
    op_comp, op, kind = found
    num_bytes = _collective_bytes(op_comp, op, kind)
    if kind == "collective-permute":
        pairs = _brace_lists(op.attrs.get("source_target_pairs", "{}"))
        group_size, axes = 2, _axes_of(pairs, mesh)  # a send/receive pair
    else:
        groups = parse_replica_groups(op.attrs.get("replica_groups", "{}"), module.num_devices)
        group_size, axes = len(groups[0]), _axes_of(groups, mesh)
    bandwidth = hardware.group_bandwidth(axes) if axes else hardware.default_link_bandwidth
    sliced = (_sliced_bytes(module, comp, inst, group_size)
              if kind == "all-reduce" and group_size > 1 else 0)
    parts = [(kind, num_bytes - sliced)] if sliced < num_bytes else []
    if sliced:   # the CPU spelling
        parts.append(("reduce-scatter", sliced))
    out = []
    for part, part_bytes in parts:
        seconds = collective_seconds(part, part_bytes, group_size, bandwidth,
                                     hardware.link_latency)
        if out:   # one op: one latency
            seconds -= hardware.link_latency
        out.append(CompiledCollective(part, part_bytes, group_size, axes, count, seconds,
                                      inst.name))
    return out


def _sliced_bytes(module: HloModule, comp: Computation, inst: Instruction,
                  group_size: int) -> int:
    """Bytes of an all-reduce's results of which every reader keeps a 1/group_size slice:
    all-reduce then keep my slice is how XLA:CPU spells reduce-scatter. A combined
    all-reduce (a tuple) is read element by element."""
    result = _result_shape(inst)
    if not result.is_tuple:
        return (result.num_bytes if _only_sliced(module, comp, inst.name, result.num_elements,
                                                 group_size) else 0)
    found = 0
    for user in comp.users(inst.name):
        if user.opcode != "get-tuple-element":
            return 0   # read whole somewhere
        element = result.elements[int(user.attrs.get("index", "0"))]
        if _only_sliced(module, comp, user.name, element.num_elements, group_size):
            found += element.num_bytes
    return found


# --------------------------------------------------------------------------- report


@dataclasses.dataclass(frozen=True)
class Report:
    """What one device does when it runs the compiled program.

    ``flops``: dot/convolution FLOPs. ``bytes_accessed``: HBM bytes read and written by
    top-level ops. ``compute_s``: sum over non-collective top-level ops of the roofline
    ``hardware.compute_seconds``. ``comm_s``: sum of collective seconds x count.
    Memory fields are bytes from ``memory_analysis()``; ``memory_bytes`` = argument +
    output + temp - alias.
    """

    flops: int
    bytes_accessed: int
    compute_s: float
    comm_s: float
    total_s: float
    collectives: tuple[CompiledCollective, ...]
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    alias_bytes: int = 0
    memory_bytes: int = 0
    warnings: tuple[str, ...] = ()
    # (times run per step, compute seconds of the ops run that often), fewest runs first:
    # 1 outside loops, a loop's trip count inside it (a pipeline's M + S - 1 steps)
    compute_s_by_runs: tuple[tuple[int, float], ...] = ()
    # of compute_s, the fusions that only round narrow floats computed wider
    # (``_rounding_pass``): where compiled bytes differ from the program's dtypes
    rounding_s: float = 0.0

    def collective_bytes(self, kind: str | None = None) -> int:
        """Bytes moved by collectives of ``kind`` (all kinds if None), times their counts."""
        return sum(c.num_bytes * c.count for c in self.collectives if kind in (None, c.kind))

    def count(self, kind: str | None = None) -> int:
        """How many collectives of ``kind`` run (all kinds if None), loop trips included."""
        return sum(c.count for c in self.collectives if kind in (None, c.kind))

    def summary(self) -> str:
        """A few human-readable lines: time, flops, bytes, memory, collectives."""
        lines = [
            f"total {self.total_s * 1e6:.2f} us = compute {self.compute_s * 1e6:.2f} us"
            f" + comm {self.comm_s * 1e6:.2f} us (per device)",
            f"flops {self.flops:.4g}  bytes accessed {self.bytes_accessed:.4g}",
            f"memory {self.memory_bytes:.4g} B = args {self.argument_bytes:.4g} + out "
            f"{self.output_bytes:.4g} + temp {self.temp_bytes:.4g} - alias {self.alias_bytes:.4g}",
        ]
        for c in self.collectives:
            axes = ",".join(c.axes) or "?"
            lines.append(f"  {c.kind:<18} {c.num_bytes:>12} B  group {c.group_size:<3} axes "
                         f"({axes})  x{c.count}  {c.seconds * 1e6:.2f} us each  [{c.name}]")
        if self.rounding_s:
            lines.append(f"of compute, {self.rounding_s * 1e6:.2f} us round narrow floats "
                         "computed wider, in fusions of their own")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Plain dict (lists, not tuples) for JSON."""
        d = dataclasses.asdict(self)
        d["collectives"] = [dict(c, axes=list(c["axes"])) for c in d["collectives"]]
        d["warnings"] = list(self.warnings)
        return d


def _memory_fields(memory: Any) -> dict[str, int]:
    """Bytes per device from a ``CompiledMemoryStats`` or a mapping of the same names."""
    if memory is None:
        return {}
    get = memory.get if isinstance(memory, Mapping) else (lambda k, d=None: getattr(memory, k, d))
    fields = {}
    for short in ("argument", "output", "temp", "alias"):
        value = get(f"{short}_size_in_bytes", None)
        if value is None:
            value = get(f"{short}_bytes", 0)
        fields[f"{short}_bytes"] = int(value or 0)
    fields["memory_bytes"] = (fields["argument_bytes"] + fields["output_bytes"]
                              + fields["temp_bytes"] - fields["alias_bytes"])
    return fields


def report_from_module(module: HloModule, hardware: Hardware, mesh=None, memory=None) -> Report:
    """Price a parsed module; see :func:`report_from_hlo_text`."""
    flops = num_bytes = 0
    compute_s = rounding_s = 0.0
    by_runs: dict[int, float] = {}
    collectives: list[CompiledCollective] = []
    warnings: list[str] = []
    for comp, inst, count in _walk(module, module.entry, 1, warnings):
        op_flops, op_bytes = _flops(module, comp, inst), _bytes(module, comp, inst)
        flops += op_flops * count
        num_bytes += op_bytes * count
        found = [] if _is_done(inst) else _collectives(module, comp, inst, count, hardware,
                                                         mesh)
        collectives += found
        for collective in found:
            widened = _widened_from(comp, inst)
            if widened:
                narrow = (collective.num_bytes * _DTYPE_BITS[widened[0]]
                          // _DTYPE_BITS[widened[1]])
                warnings.append(f"{collective.kind} {inst.name} moves {widened[1]} converted "
                                f"from the program's {widened[0]}: {collective.num_bytes} "
                                f"bytes where the program's dtype has {narrow}")
        if not found and (op_flops or op_bytes):
            seconds = hardware.compute_seconds(op_flops, op_bytes) * count
            compute_s += seconds
            by_runs[count] = by_runs.get(count, 0.0) + seconds
            fused = inst.called("calls") if inst.opcode == "fusion" else []
            if fused and _rounding_pass(module.computations[fused[0]]):
                rounding_s += seconds
    comm_s = sum(c.total_seconds for c in collectives)
    return Report(flops=flops, bytes_accessed=num_bytes, compute_s=compute_s, comm_s=comm_s,
                  total_s=compute_s + comm_s, collectives=tuple(collectives),
                  warnings=tuple(warnings), compute_s_by_runs=tuple(sorted(by_runs.items())),
                  rounding_s=rounding_s, **_memory_fields(memory))


def report_from_hlo_text(text: str, hardware: Hardware, mesh=None, memory=None) -> Report:
    """Price SPMD-partitioned HLO text (one device's program).

    ``mesh`` (a ``jax.sharding.Mesh``) attributes collectives to mesh axes; partition id i
    is ``mesh.devices.flat[i]``. ``memory`` is a ``CompiledMemoryStats`` (or a mapping with
    ``argument_size_in_bytes``/... or ``argument_bytes``/... keys); omitted, memory is 0.
    """
    return report_from_module(parse_hlo(text), hardware, mesh, memory)


def hlo_report(compiled, hardware: Hardware, mesh=None) -> Report:
    """Price a ``jax.stages.Compiled`` by its optimized HLO and ``memory_analysis()``.

    Example::

        compiled = jax.jit(f, in_shardings=s_in, out_shardings=s_out).lower(x, w).compile()
        report = hlo_report(compiled, autoshard.target.hardware.H100, mesh)
        report.count("all-reduce"), report.flops, report.memory_bytes
    """
    try:
        memory = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        memory = None
    return report_from_hlo_text(compiled.as_text(), hardware, mesh, memory)


_ALLOCATED = re.compile(r"Total bytes: (\d+)")
_ALLOCATION = re.compile(r"allocation (\d+): size \d+")
_VALUE = re.compile(r" value: <\d+ (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")
_LIVE_RANGE = re.compile(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$", re.M)


def buffer_bytes(lowered) -> tuple[int, int]:
    """(bytes held together at the peak, bytes allocated) of a ``jax.stages.Lowered`` once
    compiled, read from XLA's dump: the peak is the most bytes XLA's live buffers occupy
    at one point of its schedule, where its buffer assignment places them (offsets within
    allocations; buffers sharing bytes count once); the allocation (``memory_analysis()``'s
    total) adds the room lost packing temporaries into one heap. The planner predicts the
    former. XLA's own dumped peak (its stack-trace breakdown) leaves out buffers it holds
    through loops: 22.2 MB for an accumulated step on jax 0.12 that holds 29.4 MB
    together and allocates 29.4 MB (``test_memory.accumulated_mlp_stack``)."""
    with tempfile.TemporaryDirectory(prefix="xla-dump-") as dump:
        lowered.compile(compiler_options={"xla_dump_to": dump})
        return read_buffer_bytes(dump)


def read_buffer_bytes(dump: str | os.PathLike) -> tuple[int, int]:
    """(bytes held together at the peak, bytes allocated) of the last module XLA compiled
    with ``xla_dump_to=dump``; see :func:`buffer_bytes`."""
    found = pathlib.Path(dump)
    together = held_together(_newest(found, "-buffer-assignment.txt").read_text(),
                             _newest(found, "-live-range.txt").read_text())
    allocated = _ALLOCATED.search(_newest(found, "-memory-usage-report.txt").read_text())
    return together, int(allocated.group(1))


def held_together(assignment: str, live_ranges: str) -> int:
    """The most bytes of allocations that live buffers occupy at one point of the
    schedule, from XLA's buffer assignment (each value's allocation, offset and size) and
    its live ranges (each value's first and last point)."""
    slots, allocation = {}, None
    for line in assignment.splitlines():
        if found := _ALLOCATION.match(line):
            allocation = int(found.group(1))
        elif (found := _VALUE.match(line)) and allocation is not None:
            name = found.group(1) if "{" in found.group(1) else found.group(1) + "{}"
            offset = int(found.group(3))
            slots[name] = (allocation, offset, offset + int(found.group(2)))
    ranges = live_ranges.split("BufferLiveRange:")[-1]
    spans = sorted((int(m.group(2)), int(m.group(3)), slots[m.group(1)])
                   for m in _LIVE_RANGE.finditer(ranges) if m.group(1) in slots)
    live: list[tuple[int, tuple]] = []   # (last point, slot) of the buffers live now
    peak = 0
    for k, (start, end, slot) in enumerate(spans):
        live = [(last, held) for last, held in live if last >= start]
        live.append((end, slot))
        if k + 1 == len(spans) or spans[k + 1][0] > start:   # all that start here are in
            peak = max(peak, _covered(held for _, held in live))
    return peak


def _covered(slots) -> int:
    """Bytes of the union of (allocation, start, end) byte ranges."""
    total, reach = 0, {}
    for allocation, lo, hi in sorted(slots):
        start = max(lo, reach.get(allocation, lo))
        if hi > start:
            total += hi - start
            reach[allocation] = hi
    return total


def _newest(dump: pathlib.Path, suffix: str) -> pathlib.Path:
    """The dump file of the last module compiled (modules are numbered in order)."""
    found = sorted(dump.glob(f"module_*{suffix}"))
    if not found:
        raise FileNotFoundError(f"no XLA dump *{suffix} under {dump}")
    return found[-1]
