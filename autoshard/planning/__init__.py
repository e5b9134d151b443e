"""planning: ``autoshard.plan`` and ``auto_shard`` (``api``), their keywords (``options``),
the settings search over microbatches, pipelines and remat (``settings``), the cache and
the digests it keys on (``cache``, ``fingerprint``), and the frozen ``Plan`` (``plan``).
"""
