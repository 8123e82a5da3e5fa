"""Test and demo tooling: tiny random checkpoints in real layouts (K3 mxfp4, K2-Thinking int4), a
Hub-compatible endpoint over a folder (``cachecd hub serve``), and ``cachecd demo`` built from both.

Nothing else in cachecd imports it; the command line names its commands like any others.
"""
