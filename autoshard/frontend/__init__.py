"""frontend: JAX programs read. A function traced to a jaxpr and a ``Graph`` of nodes and
values (``trace``, ``graph``, ``interpret``), specs (``specs``), the user's input checked
(``validate``); ``jax_compat`` is the one module that reads JAX's internals.
"""
