"""Client library for the cachecd daemon."""
