"""runtime: plans run past one process. ``jax.distributed`` runs (``distributed``,
``launch``), checkpoints (``checkpoint``), the training loop (``train``) and the
``autoshard`` command (``cli``).
"""
