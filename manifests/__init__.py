"""Shipped manifests (data): one ``*.manifest`` file per supported model revision.

Found with ``importlib.resources`` so a plain (non-editable) install finds them too.
"""
