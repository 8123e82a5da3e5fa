"""The daemon as a service: ``cachecd service``, the launchd agent and systemd user unit rendered
from the shipped templates, and the two service managers that load and query them.
"""
