"""The verified disk cache: blob files, the LMDB index, the budget and eviction policies, recovery
and fsck.

The lowest layer beside the manifest and the upstream: it imports nothing of cachecd but errors and
constants, so the engine can use its policies without the daemon.
"""
