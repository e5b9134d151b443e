"""HiGHS as scipy bundles it, for LPs re-solved from their last basis.

``scipy.optimize.milp`` and ``linprog`` solve every problem afresh; ``solve.PricedLp``
re-solves one LP under changing costs from its last basis, which needs HiGHS's own model
interface. scipy bundles it, privately (``scipy.optimize._highspy``): this module is the
one place that reads it. The public ``highspy`` package has the same interface
(``passModel``, ``changeColsCost``, ``run``) and reaches the same optima, but measured no
faster on these LPs, prints a banner per instance, and cannot share a process with
ortools. ``core`` is None with a scipy that lacks the bindings; then every LP is solved
cold.
"""

from __future__ import annotations

import numpy as np

try:
    from scipy.optimize._highspy import _core as core
    if not all(hasattr(core, name) for name in ("HighsLp", "_Highs", "MatrixFormat",
                                                "kHighsInf")):
        raise ImportError("scipy's HiGHS bindings lack what warm starts use")
except ImportError:   # a scipy without them
    core = None


def lp_instance(cost: np.ndarray, col_upper: np.ndarray, a_csc, row_lower: np.ndarray,
                row_upper: np.ndarray):
    """A quiet HiGHS instance holding the LP ``min cost @ x`` over ``0 <= x <= col_upper``
    and ``row_lower <= A x <= row_upper`` (``A`` a scipy CSC array; infinite bounds as
    ``np.inf``), to be solved by dual simplex without presolve."""
    lp = core.HighsLp()
    lp.num_col_, lp.num_row_ = a_csc.shape[1], a_csc.shape[0]
    lp.col_cost_ = cost
    lp.col_lower_, lp.col_upper_ = np.zeros(a_csc.shape[1]), col_upper
    lp.row_lower_ = np.where(np.isneginf(row_lower), -core.kHighsInf, row_lower)
    lp.row_upper_ = np.where(np.isposinf(row_upper), core.kHighsInf, row_upper)
    lp.a_matrix_.format_ = core.MatrixFormat.kColwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = a_csc.shape[1], a_csc.shape[0]
    lp.a_matrix_.start_, lp.a_matrix_.index_ = a_csc.indptr, a_csc.indices
    lp.a_matrix_.value_ = a_csc.data
    highs = core._Highs()
    for option, value in (("output_flag", False), ("presolve", "off"), ("solver", "simplex"),
                          ("simplex_strategy", 1)):   # 1: dual simplex
        highs.setOptionValue(option, value)
    highs.passModel(lp)
    return highs
