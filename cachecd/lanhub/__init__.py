"""The LAN hub a user serves: ``cachecd hub serve DIR``, an HF-compatible endpoint over a folder of
model and dataset repos (a machine with one big disk for a LAN, a ``hf download --local-dir``
mirror, the tests and the demo). ``cli`` is the command, ``server`` starts it, ``app`` is its HTTP
side, ``repo`` what a folder holds at which commit, ``mirror`` the commit and hashes a download
recorded.
"""
