"""Service templates shipped as package data (``cachecd_service_templates``).

``cachecd service render|install`` fills them with string.Template; the files here are never
loaded as they are, so every ``$name`` must be a key ``cachecd.service.render`` supplies.
"""
