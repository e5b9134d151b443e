"""Primitives kept replicated on purpose, each with the reason.

They get ``replicate_all`` as their rule, so planning a program that holds one does not
warn: every operand and result stays whole on every device. ``docs/coverage.md`` lists
them (``python -m autoshard.rules.coverage``).
"""

from __future__ import annotations

from autoshard.rules import register, replicate_all

LINALG = ("dense factorization or solve: every element of the matrix dims depends on the "
          "others, and ordinary models do not emit it (its leading batch dims could split; "
          "not done)")
COLLECTIVE = ("a collective of a shard_map or pmap body, where the user partitions by "
              "hand; it never appears in the global program autoshard plans")
CALLBACK = "a host callback or check: the host sees whole values"
TOKEN = "orders effects; holds no array data"
OPAQUE = ("carries a jaxpr that trace does not inline; its operands and results are "
          "kept whole around it")

REPLICATED: dict[str, str] = {
    **{name: LINALG for name in """cholesky cholesky_update eig eigh geqp3 geqrf hessenberg
        householder_product lu lu_pivots_to_permutation ormqr qr schur svd
        symmetric_product triangular_solve tridiagonal tridiagonal_solve""".split()},
    **{name: COLLECTIVE for name in """all_gather all_gather_done all_gather_invariant
        all_gather_reduced all_gather_reduced_start all_gather_start all_to_all
        all_to_all_done all_to_all_start axis_index pbroadcast pbroadcast_done
        pbroadcast_start pmax pmin ppermute ppermute_done ppermute_start precv preduced psend
        psum psum_done psum_invariant psum_invariant_start psum_start ragged_all_to_all
        reduce_scatter reduce_scatter_done reduce_scatter_start unreduced_psum
        unreduced_psum_start unreduced_reduce_scatter unreduced_reduce_scatter_start
        vary_unreduced_cast_p vary_unreduced_cast unreduced_pmax unreduced_pmin
        pbroadcast_dynamic""".split()},
    **{name: CALLBACK for name in
       "debug_callback debug_print inspect_sharding io_callback pure_callback check".split()},
    **{name: TOKEN for name in "after_all create_token dce_sink stage".split()},
    **{name: OPAQUE for name in """composite custom_linear_solve linear_call
        custom_jvp_call_jaxpr remat_opt eval_jaxpr""".split()},
    "unreachable": "raises when run; nothing to place",
    "platform_index": "a scalar index chosen by the platform: nothing to split",
    "rng_uniform": "XLA's stateful RNG, which jax.random never emits",
    "to_edtype": "wraps key data into an extended dtype (PRNG keys are a few words)",
    "from_edtype": "unwraps key data from an extended dtype (PRNG keys are a few words)",
    "scaled_dot": "a block-scaled low-precision matmul; its scales' blocking is not modelled",
}

register(*REPLICATED)(replicate_all)
