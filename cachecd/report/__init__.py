"""Coverage reports: what of a model is local, what a workload would hit, and their renderings
(terminal table, JSON, PNG heatmap, self-contained HTML).

Computed from a manifest and the cache's answers: the daemon serves them, the commands print them.
"""
