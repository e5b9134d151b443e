"""solver: the lowest layer. What the cost stage hands it (``request.Request``, numbers
only, no jax), made smaller (``coarsen``) and solved within the memory budget (``solve``,
``search``, ``bounds``; ``highs``: HiGHS LPs re-solved from their last basis).
"""
