"""target: what a plan runs on. Per-device speeds and links (``hardware``), meshes
(``mesh``), XLA's habits read from compiled programs (``xla``), and GPU meshes without a
GPU (``deviceless``, with a target config per kind under ``configs/``).
"""
