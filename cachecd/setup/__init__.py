"""``cachecd setup --stream``: a model's revision pinned, its manifest loaded or built, its resident
weights fetched and verified by exact ranges, the model registered with a daemon started if needed.
"""
