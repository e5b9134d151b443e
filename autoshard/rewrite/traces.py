"""traces: a marked loss's jaxprs, kept across the settings one plan weighs.

The settings search (``planning/settings.py``) traces the program once per setting. Under
a remat policy or a pipeline, the marked loss is traced again inside that trace: to a
jaxpr (``pipeline.pipelined``), again where its repeated layers are rolled into a scan
(``unrolled.rolled``), and again on one microbatch's rows. Every setting traces the same
Python function at the same shapes, so its jaxpr, its run of repeated layers and the roll
of that run are kept here and read back: a setting pays the autodiff of its own program,
not the loss's Python again.

A jaxpr that closed over a tracer of the trace it was made in (a loss that closes over
its batch, under the step's trace) belongs to that trace: it is not kept.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import jax

from autoshard.frontend import jax_compat


def function_key(fun: Callable, tree, kwargs: dict) -> Hashable | None:
    """``fun`` called on flat arguments of structure ``tree`` with ``kwargs``, as a key;
    None where a keyword argument is no key (an array, a list)."""
    key = (fun, tree, tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def arguments_key(args: Sequence) -> tuple:
    """The types of flat arguments (shape, dtype, weak type, and what else JAX's type of
    each holds): the jaxpr of a function depends on nothing else of them."""
    return tuple(str(jax.typeof(x)) for x in args)


class Traces:
    """Jaxprs and what is read from them, by function and argument types."""

    def __init__(self):
        self._kept: dict = {}

    def jaxpr(self, key: Hashable | None, fun: Callable, args: Sequence):
        """``jax.make_jaxpr(fun, return_shape=True)(*args)``, kept under ``key`` (the
        function's, ``function_key``) and the arguments' types; None keeps nothing."""
        if key is None:
            return jax.make_jaxpr(fun, return_shape=True)(*args)
        full = ("jaxpr", key, arguments_key(args))
        found = self._kept.get(full)
        if found is None:
            found = jax.make_jaxpr(fun, return_shape=True)(*args)
            if not any(jax_compat.is_tracer(c) for c in found[0].consts):
                self._kept[full] = found
        return found

    def read(self, what: Hashable, key: Hashable | None, args: Sequence, make: Callable):
        """``make()``: something read from the jaxpr of the function ``key`` at ``args``
        (its repeated layers, their roll), kept with that jaxpr."""
        full = ("jaxpr", key, arguments_key(args))
        if key is None or full not in self._kept:
            return make()
        read_key = (what, full)
        if read_key not in self._kept:
            self._kept[read_key] = make()
        return self._kept[read_key]

    def remembered(self, what: Hashable, key: Hashable | None):
        """What was remembered of the function ``key`` at any arguments (None: nothing)."""
        return None if key is None else self._kept.get((what, key))

    def remember(self, what: Hashable, key: Hashable | None, value) -> None:
        """Remember ``value`` of the function ``key``, whatever its arguments."""
        if key is not None:
            self._kept[what, key] = value
