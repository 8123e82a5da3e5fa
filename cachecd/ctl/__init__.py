"""Commands that ask a running daemon through ``cachecd_client``: ``status``, ``pin``, ``unpin``,
``evict``, ``coverage``, ``warm`` (and ``fsck``, which opens a stopped daemon's cache itself).
"""
