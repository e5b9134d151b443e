"""fingerprint: digests of what a plan depends on and of what it decides, in one place.

- ``program_fingerprint``: the traced program (equations, types, argument avals).
- ``plan_key``: the cache's key: the program, the mesh, the hardware, the options that
  decide the plan, and autoshard's own code (``source_hash``).
- ``plan_hash``: what a plan decides (every spec and decision): processes of one run and
  a checkpoint's reader compare it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import re
from typing import TYPE_CHECKING

import numpy as np

from autoshard.frontend.jax_compat import Literal, is_jaxpr, split_closed

if TYPE_CHECKING:
    from autoshard.planning.options import PlanOptions


def program_fingerprint(closed_jaxpr, in_avals) -> str:
    """A digest of the program: every equation in order (primitive, params, operands and
    results with their types, nested jaxprs in full) and the argument avals. Programs that
    differ only in variable names or in the values of constants share it; constants are
    known by type, as no plan depends on their values."""
    text = JaxprText()
    text.jaxpr(closed_jaxpr.jaxpr)
    text.parts.append(repr([(tuple(a.shape), str(a.dtype)) for a in in_avals]))
    return hashlib.sha256("\n".join(text.parts).encode()).hexdigest()[:16]


ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class JaxprText:
    """A jaxpr written out line by line, the same in every process: variables numbered in
    order of appearance, types and params in full, literals by their bytes, and a jaxpr
    met again (a jitted function called twice) by its number."""

    def __init__(self):
        self.parts: list[str] = []
        self.var_numbers: dict = {}
        self.aval_texts: dict = {}
        self.jaxpr_numbers: dict[int, int] = {}   # by id: the program holds every jaxpr

    def jaxpr(self, jaxpr) -> int:
        """Write ``jaxpr`` (a Jaxpr or ClosedJaxpr) unless written already; its number."""
        jaxpr, _ = split_closed(jaxpr)
        number = self.jaxpr_numbers.get(id(jaxpr))
        if number is not None:
            return number
        self.jaxpr_numbers[id(jaxpr)] = number = len(self.jaxpr_numbers)
        self.parts.append(f"jaxpr {number} {self.binders(jaxpr.constvars)}; "
                          f"{self.binders(jaxpr.invars)}")
        for eqn in jaxpr.eqns:
            params = ",".join(f"{k}={self.param(v)}" for k, v in eqn.params.items())
            self.parts.append(f"{self.binders(eqn.outvars)} = {eqn.primitive.name}"
                              f"[{params}] {self.atoms(eqn.invars)}")
        self.parts.append(f"return {self.atoms(jaxpr.outvars)}")
        return number

    def aval(self, aval) -> str:
        text = self.aval_texts.get(aval)
        if text is None:
            text = self.aval_texts[aval] = repr(aval)
        return text

    def binders(self, variables) -> str:
        numbers, out = self.var_numbers, []
        for var in variables:
            numbers[var] = n = len(numbers)
            out.append(f"{n}:{self.aval(var.aval)}")
        return " ".join(out)

    def atoms(self, atoms) -> str:
        numbers = self.var_numbers
        return " ".join(self.literal(a) if isinstance(a, Literal) else str(numbers[a])
                        for a in atoms)

    def literal(self, literal) -> str:
        val = literal.val
        if isinstance(val, (np.ndarray, np.generic)):
            text = f"{val.dtype.str}{val.shape}{val.tobytes().hex()}"
        else:
            text = repr(val)
        return f"{text}:{self.aval(literal.aval)}"

    def param(self, value) -> str:
        if is_jaxpr(value):
            return f"jaxpr {self.jaxpr(value)}"
        if type(value) is tuple and value and all(is_jaxpr(j) for j in value):
            return "(" + ",".join(f"jaxpr {self.jaxpr(j)}" for j in value) + ")"
        text = str(value)
        return ADDRESS.sub(" at 0x", text) if " at 0x" in text else text


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """autoshard's own code: a changed planner must not find its predecessor's plans."""
    root = pathlib.Path(__file__).parent.parent   # the autoshard package
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def plan_key(fingerprint: str, paths, options: PlanOptions) -> str:
    """A hex digest of everything a plan depends on: the program (``fingerprint``, its
    argument ``paths``), the options' mesh and hardware, the rest of the options that
    decide the plan (``PlanOptions.key_options``) and autoshard's code."""
    mesh = options.mesh
    mesh_desc = {"axis_names": list(mesh.axis_names), "shape": list(mesh.devices.shape),
                 "platform": mesh.devices.flat[0].platform}
    text = json.dumps({"program": fingerprint, "paths": list(paths), "mesh": mesh_desc,
                       "hardware": options.hardware.to_dict(),
                       "options": options.key_options(), "code": source_hash()},
                      sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def plan_hash(plan) -> str:
    """A hash of what the plan decides: program fingerprint, mesh, every spec and decision.

    Costs, solver timings and the runner-up specs are left out; two plans with the same
    hash shard the same program the same way on the same mesh.

    Example::

        assert plan_hash(plan) == plan_hash(autoshard.Plan.from_json(plan.to_json(), mesh))
    """
    d = plan.to_dict()
    kept = {"fingerprint": d["fingerprint"], "mesh": d["mesh"],
            "donate_argnums": d["donate_argnums"],
            "arguments": [[a["path"], a["shape"], a["dtype"], a["spec"]] for a in d["arguments"]],
            "outputs": d["outputs"], "decisions": d["decisions"]}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
