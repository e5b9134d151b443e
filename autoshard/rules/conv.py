"""conv_general_dilated: batch and output-feature splits, input features contracted.

Grouped convolutions split on groups. With ``feature_group_count`` G (grouped and
depthwise convs and their input gradients) the input features, the kernel's output
features and the result's features are G contiguous groups: a split over whole groups
keeps each device's inputs and kernels together, so it needs no collective. With
``batch_group_count`` G (the kernel gradient of a grouped conv) the input's batch-position
dim holds the groups, the kernel's output features too, and the contracted
feature-position dims (the model's batch) split as a partial sum, as in data parallel.
XLA's partitioner all-reduces that partial sum over every device, replicas included (a
split contraction with a mesh axis left over comes out times that axis's size), so it
splits only where every mesh axis splits the conv. A grouped conv of several input
features a group that XLA's partitioner does not read as a dot (``splits_groups``: over
a window, at a stride, padded) is computed whole where XLA's partitioner computes it so
(``xla.partitions_grouped_conv``): batch and groups alike.
"""

from __future__ import annotations

import math

from autoshard.rules import Einsum, LabelMaker, register
from autoshard.target.xla import partitions_grouped_conv


def partitioner_gathers(node, feature_groups: int) -> bool:
    """Whether XLA's partitioner gathers a conv's operands and computes it whole: a
    grouped conv with several input features a group, not a dot in every spatial dim
    (``splits_groups``), where this XLA does so (``xla.partitions_grouped_conv``)."""
    rhs, rhs_spec = node.operand_shapes[1], node.params["dimension_numbers"].rhs_spec
    return (feature_groups > 1 and rhs[rhs_spec[1]] > 1 and splits_groups(node)
            and not partitions_grouped_conv())


def splits_groups(node) -> bool:
    """Whether XLA's partitioner splits a grouped conv's groups correctly: not where the
    conv is a dot in every spatial dim (``dot_in_every_spatial_dim``: a 1x1 grouped conv
    at stride one, a grouped conv's kernel gradient over a window of one, a window as
    large as its input). Split over groups, XLA:CPU gives such a conv wrong numbers on a
    mesh with an axis left over (0.93 off, relative), and aborts (``free(): invalid
    pointer``) with one input feature a group."""
    return not dot_in_every_spatial_dim(node)


def dot_in_every_spatial_dim(node) -> bool:
    """Whether XLA's partitioner reads a conv as a dot (``dot_as_convolution_util``'s
    ``ParseConvolutionDimsInfo`` finds no spatial dim of a conv): each spatial dim is a
    free one (a window of one at stride one, unpadded, undilated), a contracted one (a
    window as large as the input, unpadded, undilated, at any stride) or a batch one
    (the input's size as window and base dilation, at a stride or window dilation one
    less: how a dot written as a conv batches). A 1x1 window at stride 3 is a conv."""
    lhs, rhs = node.operand_shapes
    p, dn = node.params, node.params["dimension_numbers"]
    ones = (1,) * (len(lhs) - 2)
    strides, padding = p.get("window_strides", ones), p.get("padding", ((0, 0),) * len(ones))
    base, window_dilation = p.get("lhs_dilation") or ones, p.get("rhs_dilation") or ones
    for k, (lhs_dim, rhs_dim) in enumerate(zip(dn.lhs_spec[2:], dn.rhs_spec[2:])):
        n, w, stride = lhs[lhs_dim], rhs[rhs_dim], strides[k]
        unpadded, spread = tuple(padding[k]) == (0, 0), max(1, n - 1)
        plain = unpadded and window_dilation[k] == 1
        batch = unpadded and n == w == base[k] and (
            (stride, window_dilation[k]) in ((spread, 1), (1, spread)))
        contracted = plain and base[k] == 1 and n == w
        free = plain and base[k] == 1 and w == 1 and stride == 1
        if not (batch or contracted or free):
            return False
    return True


@register("conv_general_dilated")
def conv(node, out_shapes) -> Einsum:
    lhs, rhs = node.operand_shapes
    (out,) = out_shapes
    dn = node.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    feature_groups = node.params["feature_group_count"]
    batch_groups = node.params["batch_group_count"]
    labels = LabelMaker()
    lhs_t: list = [None] * len(lhs)
    rhs_t: list = [None] * len(rhs)
    out_t: list = [None] * len(out)
    reduce = set()
    whole = partitioner_gathers(node, feature_groups)
    if batch_groups == 1 and not whole:
        lhs_t[lhs_spec[0]] = out_t[out_spec[0]] = labels.new(lhs[lhs_spec[0]])
    if feature_groups == 1 and batch_groups == 1:
        rhs_t[rhs_spec[0]] = out_t[out_spec[1]] = labels.new(rhs[rhs_spec[0]])
    else:   # groups: the major factor of the grouped dims
        group = (labels.new(max(feature_groups, batch_groups), "g")
                 if splits_groups(node) and not whole else None)
        grouped_lhs = lhs_spec[1] if feature_groups > 1 else lhs_spec[0]
        lhs_t[grouped_lhs] = rhs_t[rhs_spec[0]] = out_t[out_spec[1]] = group
    if feature_groups == 1:   # the contraction is over whole input features
        lhs_t[lhs_spec[1]] = rhs_t[rhs_spec[1]] = labels.new(lhs[lhs_spec[1]])
        if lhs_t[lhs_spec[1]]:
            reduce.add(lhs_t[lhs_spec[1]])
    kernel = math.prod(rhs[d] for d in rhs_spec[1:])  # input features x window
    flops = 2.0 * math.prod(out) * kernel
    return Einsum((tuple(lhs_t), tuple(rhs_t)), (tuple(out_t),), labels.sizes,
                  reduce=frozenset(reduce), flops=flops, contraction=True,
                  reduces_over_all_devices=batch_groups > 1)
