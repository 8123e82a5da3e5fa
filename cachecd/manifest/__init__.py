"""Manifests: which bytes of a pinned revision are which routed expert, with their hashes.

The ``Manifest`` and its rows, their encoding and checks, the builder and its sources, and
``cachecd manifest``. The daemon and the engine both read manifests; this package imports nothing
of cachecd but errors and constants.
"""
