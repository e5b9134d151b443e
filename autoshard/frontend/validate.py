"""validate: every public entry point checks its inputs here, before any work.

Each check raises an ``AutoshardError`` subclass whose message names the culprit (the
keyword, the argument path, the field, the file) and what was expected, so a bad input
never escapes as a raw ``TypeError`` from deep inside tracing, the solver or numpy.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import pathlib
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from autoshard.errors import (
    AutoshardError,
    InputError,
    MeshError,
    OptionError,
    PathError,
    PinError,
    PlanError,
    TraceError,
)

LIBRARY_PACKAGES = ("jax", "jaxlib", "autoshard", "flax", "optax", "numpy")


def library_dirs() -> tuple[str, ...]:
    """Directories of the packages whose frames are not the user's."""
    import sys
    return tuple(str(pathlib.Path(sys.modules[name].__file__).resolve().parent) + os.sep
                 for name in LIBRARY_PACKAGES
                 if getattr(sys.modules.get(name), "__file__", None))


def type_name(value) -> str:
    return type(value).__name__


# -- numbers and keywords ---------------------------------------------------------------------

def number(name: str, value, *, positive: bool = False, allow_zero: bool = True,
           allow_inf: bool = False, error=OptionError) -> float:
    """``value`` as a float: a real number (not a bool), finite unless ``allow_inf``,
    non-negative, and non-zero unless ``allow_zero``; else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be a number, got {type_name(value)} {value!r}")
    x = float(value)
    if math.isnan(x):
        raise error(f"{name} must be a number, got NaN")
    if math.isinf(x) and not (allow_inf and x > 0):
        raise error(f"{name} must be finite, got {x}")
    if x < 0 or (x == 0 and not allow_zero) or (positive and x <= 0):
        wanted = "positive" if positive or not allow_zero else "non-negative"
        raise error(f"{name} must be {wanted}, got {value!r}")
    return x


def flag(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, (bool, np.bool_)):
        wanted = "True, False or None" if allow_none else "True or False"
        raise OptionError(f"{name} must be {wanted}, got {type_name(value)} {value!r}")


def argnums(name: str, value, num_args: int | None = None) -> tuple[int, ...]:
    """``donate_argnums``: an int or a sequence of distinct ints naming arguments."""
    items = (value,) if isinstance(value, numbers.Integral) and not isinstance(value, bool) \
        else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise OptionError(f"{name} must be a sequence of argument indices, got "
                          f"{type_name(value)} {value!r}")
    out = []
    for i in items:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise OptionError(f"{name} must hold argument indices (ints), got "
                              f"{type_name(i)} {i!r}")
        if i < 0 or (num_args is not None and i >= num_args):
            raise OptionError(f"{name} names argument {i}, but the function is called with "
                              f"{num_args} arguments (indices 0..{(num_args or 0) - 1})")
        if int(i) in out:
            raise OptionError(f"{name} repeats argument {i}")
        out.append(int(i))
    return tuple(out)


def function(fn, what: str = "fn") -> Callable:
    if not callable(fn):
        raise InputError(f"{what} must be a callable (the function to shard), got "
                         f"{type_name(fn)} {fn!r:.60}")
    return fn


def pin_options(pins) -> None:
    """``pins``: ``{path: PartitionSpec}``, or a pytree like ``jax.jit``'s ``in_shardings``
    (a tuple or list with an entry per argument, or one spec for all) whose leaves are
    ``PartitionSpec``, ``NamedSharding`` or ``None``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    if pins is None:
        return
    if isinstance(pins, Mapping):
        for path in pins:
            if not isinstance(path, str):
                raise OptionError(f"pins keys must be argument paths (str), got "
                                  f"{type_name(path)} {path!r}")
        return
    if not isinstance(pins, (tuple, list, PartitionSpec, NamedSharding)):
        raise OptionError("pins must map argument paths to PartitionSpecs, e.g. "
                          f"{{\"batch\": P('data')}}, or be a tuple with a pytree of "
                          f"PartitionSpec / NamedSharding / None per argument, got "
                          f"{type_name(pins)}")

    def is_leaf(x):
        return x is None or isinstance(x, (PartitionSpec, NamedSharding))
    for path, leaf in jax.tree_util.tree_flatten_with_path(pins, is_leaf=is_leaf)[0]:
        if not is_leaf(leaf):
            raise PinError(f"pins{jax.tree_util.keystr(path)}: expected a PartitionSpec, "
                              f"NamedSharding or None (free), got {type_name(leaf)} {leaf!r}")


def count_or_auto(name: str, value, meaning: str = "") -> None:
    """``value`` of option ``name`` is None, ``"auto"`` or a positive int, or
    ``InputError`` (``meaning``: what its values mean, for the message)."""
    if value is None or isinstance(value, str) and value == "auto":
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name} must be None, a positive int{meaning} or 'auto', "
                         f"not {value!r}")


# -- paths ------------------------------------------------------------------------------------

def as_path(name: str, value) -> pathlib.Path:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise PathError(f"{name} must be a path (str or os.PathLike), got {type_name(value)} "
                        f"{value!r}")
    return pathlib.Path(os.fspath(value))


def directory_path(name: str, value, *, create: bool = False, must_exist: bool = False):
    """A directory autoshard may write into: an existing writable one, or (``create``) one
    whose nearest existing parent is a writable directory."""
    path = as_path(name, value)
    if path.exists():
        if not path.is_dir():
            raise PathError(f"{name} {str(path)!r} is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise PathError(f"{name} {str(path)!r} is not writable")
        return path
    if must_exist:
        raise PathError(f"{name} {str(path)!r} does not exist")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise PathError(f"{name} {str(path)!r} cannot be created: {str(parent)!r} is not a "
                        "writable directory")
    return path


def writable_file(name: str, value) -> pathlib.Path:
    """A file path whose directory exists and is writable (the file itself may not exist)."""
    path = as_path(name, value)
    if path.is_dir():
        raise PathError(f"{name} {str(path)!r} is a directory, not a file")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise PathError(f"{name} {str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists()
                                                     and not os.access(path, os.W_OK)):
        raise PathError(f"{name} {str(path)!r} is not writable")
    return path


# -- arrays -----------------------------------------------------------------------------------

JAX_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu",
              "float4_e2m1fn", "int4", "uint4", "int2", "uint2")


def is_jax_dtype(dtype: np.dtype) -> bool:
    """bfloat16 and the float8 and int4 types (ml_dtypes, numpy kind 'V') are JAX's own."""
    import jax.numpy as jnp
    return any(dtype == jnp.dtype(name) for name in JAX_DTYPES if hasattr(jnp, name))


def leaf_dtype(path: str, dtype) -> None:
    """String, object and other non-numeric arrays have no place in a JAX program."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return   # JAX's own extended dtypes (PRNG keys)
    if dtype.kind in "OSUVMm" and not is_jax_dtype(dtype):
        raise InputError(f"argument {path} has dtype {np.dtype(dtype)}, which JAX cannot "
                         "trace: pass numeric or boolean arrays")


def output_leaves(leaves_with_paths) -> None:
    """The traced function's results must be arrays (or numbers)."""
    import jax

    from autoshard.frontend.jax_compat import is_tracer
    for key_path, leaf in leaves_with_paths:
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic, numbers.Number)) or \
                is_tracer(leaf):
            continue
        raise InputError(f"output out{jax.tree_util.keystr(key_path)} is a {type_name(leaf)}, "
                         "not an array: the function must return pytrees of arrays")


# -- tracing ----------------------------------------------------------------------------------

def user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``error``'s traceback outside jax and autoshard."""
    frames = traceback.extract_tb(error.__traceback__)
    skip = library_dirs()
    own = [f for f in frames if not f.filename.startswith("<")
           and not str(pathlib.Path(f.filename).resolve()).startswith(skip)]
    return own[-1] if own else None


@contextlib.contextmanager
def tracing(fn: Callable, arguments: Mapping[str, Any] | None = None):
    """Errors the user's function raises while JAX traces it become a ``TraceError`` that
    names the function and the user's own file:line, with the original chained; and,
    given ``arguments`` (by parameter name), the arguments the failing line of ``fn``
    reads, with their shapes and dtypes (or None)."""
    try:
        yield
    except AutoshardError:
        raise
    except Exception as e:
        name = getattr(fn, "__qualname__", None) or type_name(fn)
        frame = user_frame(e)
        where = f" at {frame.filename}:{frame.lineno} ({frame.name})" if frame else ""
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        read = arguments_read(fn, frame, arguments or {})
        reads = f"; the line reads {', '.join(read)}" if read else ""
        raise TraceError(f"tracing {name} failed{where}: {type(e).__name__}: {first}{reads}",
                         frame) from e


def arguments_read(fn: Callable, frame, arguments: Mapping[str, Any]) -> list[str]:
    """``path: dtype[shape]`` (or ``path: None``) of each argument leaf that ``frame``'s
    line reads, where that line is in ``fn``'s own body: the parameters it names, followed
    through constant subscripts and attributes (``batch["x"]``, ``params.w``)."""
    code = getattr(fn, "__code__", None)
    if frame is None or code is None or not frame.line or (
            frame.name, frame.filename) != (code.co_name, code.co_filename):
        return []
    import ast
    try:
        tree = ast.parse(frame.line.strip())
    except SyntaxError:
        return []
    # an expression read by a subscript or attribute is not read whole
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, (ast.Subscript, ast.Attribute))}
    reads = {}   # path: (column, subtree)
    for node in ast.walk(tree):
        reached = None if id(node) in inner else argument_at(node, arguments)
        if reached is not None and reached[0] not in reads:
            reads[reached[0]] = (node.col_offset, reached[1])
    described = {}
    for where, (_, subtree) in sorted(reads.items(), key=lambda r: r[1][0]):
        described.update(describe_leaves(where, subtree))
    return [f"{path}: {text}" for path, text in described.items()]


def argument_at(node, arguments: Mapping[str, Any]) -> tuple[str, Any] | None:
    """(path, subtree) of the argument an expression reads (a parameter, subscripted by
    constants or read by attribute), or None."""
    import ast
    keys = []
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        if isinstance(node, ast.Attribute):
            keys.append(("attr", node.attr))
        elif isinstance(node.slice, ast.Constant):
            keys.append(("item", node.slice.value))
        else:
            return None
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in arguments:
        return None
    path, value = node.id, arguments[node.id]
    for kind, key in reversed(keys):
        try:
            value = getattr(value, key) if kind == "attr" else value[key]
        except Exception:   # not a pytree node of the argument: read it whole
            break
        path += f".{key}" if kind == "attr" else f"[{key!r}]"
    return path, value


def describe_leaves(path: str, tree) -> dict[str, str]:
    """Per leaf of ``tree`` (None included): its path under ``path`` and dtype[shape]."""
    import jax
    found = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: x is None)[0]:
        where = path + jax.tree_util.keystr(key_path)
        if leaf is None:
            found[where] = "None"
        elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            found[where] = f"{dtype_text(leaf.dtype)}{list(leaf.shape)}"
        else:
            found[where] = type_name(leaf)
    return found


# -- plans ------------------------------------------------------------------------------------

def dtype_text(dtype) -> str:
    try:
        return str(np.dtype(dtype))
    except TypeError:
        return str(dtype)


def leaf_paths(tree) -> list[str]:
    """``args[0]['w']``-style paths of a tuple of arguments' leaves."""
    import jax
    return [f"args[{k[0].idx}]" + jax.tree_util.keystr(tuple(k[1:]))
            for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def arguments_match(arguments: Sequence, in_tree, args):
    """``args`` have the tree, shapes and dtypes the plan was made for, or ``PlanError``
    naming the first argument path that differs, what was expected and what came."""
    import jax
    args = tuple(args)
    leaves, tree = jax.tree_util.tree_flatten(args)
    if tree != in_tree:
        if len(args) != len(in_tree.children()):
            raise PlanError(f"the plan was made for {len(in_tree.children())} arguments, got "
                            f"{len(args)}")
        want = leaf_paths(jax.tree_util.tree_unflatten(in_tree, [0] * in_tree.num_leaves))
        got = leaf_paths(args)
        missing = [p for p in want if p not in got]
        extra = [p for p in got if p not in want]
        detail = (f"missing {missing[0]}" if missing else "") + \
            (", " if missing and extra else "") + (f"unexpected {extra[0]}" if extra else "")
        raise PlanError(f"arguments differ in structure from the plan's: "
                        f"{detail or f'got {tree}, want {in_tree}'}")
    for info, leaf in zip(arguments, leaves):
        shape = tuple(np.shape(leaf))
        dtype = dtype_text(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
        if shape != tuple(info.shape) or dtype != info.dtype:
            raise PlanError(
                f"argument {info.path}: the plan was made for {info.dtype}{list(info.shape)}, "
                f"got {dtype}{list(shape)}; plan again for these arguments (auto_shard does "
                "this per signature)")


def plan_text(text) -> Mapping[str, Any]:
    """Plan JSON parsed, or ``PlanError`` saying where it is malformed or truncated."""
    import json
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise PlanError(f"Plan.from_json takes the JSON text (str), got {type_name(text)}")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"plan JSON is malformed or truncated: {e.msg} at line {e.lineno} "
                        f"column {e.colno}") from e
    if not isinstance(d, dict):
        raise PlanError(f"plan JSON must be an object, got {type_name(d)}")
    for key in ("format", "fingerprint", "mesh", "hardware", "arguments", "outputs",
                "decisions", "cost", "memory_budget", "donate_argnums"):
        if key not in d:
            raise PlanError(f"plan JSON has no field {key!r} (truncated or not a plan)")
    return d


def spec_axes(where: str, spec, axis_names: Sequence[str]) -> None:
    """Every mesh axis a JSON spec names is one of the mesh's."""
    if spec is None:
        return
    if not isinstance(spec, list) or not all(isinstance(d, list) for d in spec):
        raise PlanError(f"{where}: spec {spec!r} is not a list of lists of axis names")
    for dim in spec:
        for axis in dim:
            if axis not in axis_names:
                raise PlanError(f"{where}: spec names mesh axis {axis!r}, which the mesh "
                                f"does not have (axes: {list(axis_names)})")


def mesh_axis_names(axis_names) -> None:
    """A mesh's axis names are distinct: a spec names an axis, and a repeated one would
    name two."""
    for n in axis_names:
        if list(axis_names).count(n) > 1:
            raise MeshError(f"mesh axis name {n!r} repeats in {tuple(axis_names)}: each mesh "
                            "axis needs a name of its own")


def mesh_arguments(axis_shapes, axis_names) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``make_mesh``'s shape and names: positive ints, distinct strings, one per axis."""
    for what, value in (("axis_shapes", axis_shapes), ("axis_names", axis_names)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise MeshError(f"make_mesh {what} must be a sequence, got {type_name(value)} "
                            f"{value!r}")
    for s in axis_shapes:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise MeshError(f"mesh shape {tuple(axis_shapes)} must hold ints, got "
                            f"{type_name(s)} {s!r}")
        if s <= 0:
            raise MeshError(f"mesh shape {tuple(axis_shapes)} must be positive, got {s}")
    for n in axis_names:
        if not isinstance(n, str) or not n:
            raise MeshError(f"mesh axis names {tuple(axis_names)} must be non-empty strings, "
                            f"got {type_name(n)} {n!r}")
    seen = set()
    for n in axis_names:
        if n in seen:
            raise MeshError(f"mesh axis name {n!r} repeats in {tuple(axis_names)}")
        seen.add(n)
    return tuple(int(s) for s in axis_shapes), tuple(axis_names)


def hardware_fields(hw) -> None:
    """Every speed and size positive and finite; latency non-negative."""
    from autoshard.errors import HardwareError
    for name in ("flops", "hbm_bandwidth", "memory", "default_link_bandwidth"):
        number(f"Hardware.{name}", getattr(hw, name), positive=True, error=HardwareError)
    number("Hardware.link_latency", hw.link_latency, error=HardwareError)
    if isinstance(hw.link_bandwidth, Mapping):
        for axis, bw in hw.link_bandwidth.items():
            if not isinstance(axis, str):
                raise HardwareError(f"Hardware.link_bandwidth keys must be mesh axis names "
                                    f"(str), got {type_name(axis)} {axis!r}")
            number(f"Hardware.link_bandwidth[{axis!r}]", bw, positive=True,
                   error=HardwareError)
    else:
        number("Hardware.link_bandwidth", hw.link_bandwidth, positive=True, error=HardwareError)


# -- views ------------------------------------------------------------------------------------

def optional_count(name: str, value) -> None:
    """None or a positive int (``top=``)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise OptionError(f"{name} must be a positive int or None, got {type_name(value)} "
                          f"{value!r}")


def mapping(name: str, value, *, allow_empty: bool = False) -> None:
    if not isinstance(value, Mapping):
        raise OptionError(f"{name} must be a mapping (dict), got {type_name(value)}")
    if not value and not allow_empty:
        raise OptionError(f"{name} is empty: give at least one entry")


def names_pair(name: str, value) -> None:
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(n, str) for n in value)):
        raise OptionError(f"{name} must be two strs, e.g. ('auto', 'fsdp'), got {value!r}")
