"""The daemon (``cachecd serve``): the state both front doors share, the HTTP/JSON control door,
the zero-copy fd data path, the socket rules, metrics, and the filler that turns misses into
verified entries. It composes the store, the upstream, the manifests and the reports.
"""
