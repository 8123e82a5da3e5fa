"""The Xet protocol's core, shared by the local hub (which serves it) and the daemon (which reads
and proves through it): content-defined chunking (``chunking``), chunk, tree and file hashes
(``hashing``), xorb chunk encoding (``xorb``), partial trees (``subtree``) and range proofs
(``proof``). Pure functions over bytes; no I/O, no network. Imports only cachecd.errors and
cachecd.constants. The spec: hub-docs ``docs/xet/``; the reference: xet-core and hf-xet.
"""
