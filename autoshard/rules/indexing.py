"""gather and scatter, as produced by embedding lookups and take_along_axis.

gather: output batch dims split with the indices' batch dims, output offset dims with the
operand's whole-sliced dims (indexed or not: XLA clamps a whole slice's start to 0, so a
device slices its own shard), batching dims on all three. An operand dim indexed with
slice size 1 (an embedding table's vocabulary) may split too: each device looks up the
rows it holds and the partial results are summed (vocab-parallel embedding).
scatter-add and scatter-sub: an update's scatter dims may split: each device adds its part,
partial sums.
scatter of any kind: an operand dim indexed with slice size 1 (the vocabulary of a
take_along_axis gradient) may split: each device applies the updates that land in the rows
it holds, so the result stays split and nothing is summed.
"""

from __future__ import annotations

import math

from autoshard.rules import Einsum, LabelMaker, register


@register("gather")
def gather(node, out_shapes) -> Einsum:
    dn = node.params["dimension_numbers"]
    slice_sizes = node.params["slice_sizes"]
    operand, indices = node.operand_shapes
    (out_shape,) = out_shapes
    labels = LabelMaker()
    op_t: list = [None] * len(operand)
    idx_t: list = [None] * len(indices)
    out_t: list = [None] * len(out_shape)
    batch_out = [d for d in range(len(out_shape)) if d not in dn.offset_dims]
    idx_batch = list(range(len(indices) - 1))  # the last dim is the index vector
    for o, i in zip(batch_out, idx_batch):
        out_t[o] = idx_t[i] = labels.new(out_shape[o])
    for op_dim, idx_dim in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        op_t[op_dim] = labels.shrink(idx_t[idx_dim], operand[op_dim]) \
            if idx_t[idx_dim] else None
        idx_t[idx_dim] = op_t[op_dim]
        out_t[batch_out[idx_batch.index(idx_dim)]] = op_t[op_dim]
    window = [d for d in range(len(operand))
              if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for o, d in zip(dn.offset_dims, window):   # a whole-sliced dim's start clamps to 0
        if slice_sizes[d] == operand[d]:
            op_t[d] = out_t[o] = labels.new(operand[d])
    reduce = set()
    indexed = [d for d in dn.start_index_map if d in dn.collapsed_slice_dims]
    if len(indexed) == 1 and len(dn.start_index_map) == 1:
        op_t[indexed[0]] = labels.new(operand[indexed[0]])
        if op_t[indexed[0]]:
            reduce.add(op_t[indexed[0]])
    return Einsum((tuple(op_t), tuple(idx_t)), (tuple(out_t),), labels.sizes,
                  reduce=frozenset(reduce), flops=float(math.prod(out_shape)))


ADDITIVE = ("scatter-add", "scatter_add", "scatter-sub", "scatter_sub")


@register(*ADDITIVE, "scatter", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
          "scatter-max", "scatter_max")
def scatter(node, out_shapes) -> Einsum:
    dn = node.params["dimension_numbers"]
    operand, indices, updates = node.operand_shapes
    labels = LabelMaker()
    op_t: list = [None] * len(operand)
    idx_t: list = [None] * len(indices)
    upd_t: list = [None] * len(updates)
    scatter_dims = [d for d in range(len(updates)) if d not in dn.update_window_dims]
    idx_batch = list(range(len(indices) - 1))
    additive = node.primitive in ADDITIVE
    for op_dim, idx_dim in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
        label = labels.new(operand[op_dim])
        op_t[op_dim] = idx_t[idx_dim] = upd_t[scatter_dims[idx_batch.index(idx_dim)]] = label
    reduce = set()
    if additive:
        for u, i in zip(scatter_dims, idx_batch):
            if upd_t[u] is None:
                upd_t[u] = idx_t[i] = labels.new(updates[u])
                if upd_t[u]:
                    reduce.add(upd_t[u])
    window = [d for d in range(len(operand))
              if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    for u, d in zip(dn.update_window_dims, window):
        if updates[u] == operand[d] and d not in dn.scatter_dims_to_operand_dims:
            op_t[d] = upd_t[u] = labels.new(operand[d])
    indexed = [d for d in dn.scatter_dims_to_operand_dims if d in dn.inserted_window_dims]
    if len(indexed) == 1 and len(dn.scatter_dims_to_operand_dims) == 1:
        op_t[indexed[0]] = labels.new(operand[indexed[0]])
    return Einsum((tuple(op_t), tuple(idx_t), tuple(upd_t)), (tuple(op_t),), labels.sizes,
                  reduce=frozenset(reduce), flops=float(math.prod(updates)))
