"""Where expert bytes come from: one interface for sources (``source.ExpertSource``), the Hub as
one (``hub_client``: resolve cache, exact Range GETs, retries, its HTTP rules), a local folder as
another (``local_folder``, for tests), the choice of one from the settings (``choose``), and the
verify-then-commit path written once above them all (``fetch.Upstream``: coalescing, streaming,
hashing against the manifest).

It imports nothing of cachecd but errors and constants, and the manifest's checks for a source's
check on use; manifest entries reach it as duck types.
"""
