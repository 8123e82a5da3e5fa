"""Commands that ask a running daemon through ``cachecd_client``: ``status``, ``pin``, ``unpin``,
``evict``, ``remove``, ``coverage``, ``warm`` (and ``fsck``, which opens a stopped daemon's cache
itself).
"""

# --model of the commands that resolve it with cachecd_client.resolve_model when left out.
MODEL_HELP = ("ORG/NAME[@REV] (default: the one model the daemon has registered; @REV, a commit "
              "or its first 7+ hex digits, when several revisions of it are)")
