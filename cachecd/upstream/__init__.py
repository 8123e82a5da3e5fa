"""Where expert bytes come from: a Hub client (resolve cache, exact Range GETs, retries), its HTTP
rules, coalescing of neighbouring experts, and fetches verified before anything commits them.

It imports nothing of cachecd but errors and constants; manifest entries reach it as duck types.
"""
