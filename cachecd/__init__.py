"""cachecd: a verified, LMDB-indexed disk cache of MoE experts streamed from the Hugging Face Hub."""

from cachecd.constants import VERSION as __version__

__all__ = ["__version__"]
