"""rewrite: programs rewritten for a plan. Sharding constraints at the decisions
(``apply``), gradient accumulation (``accumulate``), layer stacks pipelined or
rematerialized (``pipeline``), and Python loops over layers rolled into stacks
(``unrolled``).
"""
