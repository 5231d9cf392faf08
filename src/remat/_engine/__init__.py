"""The checkpoint core. Read in this order: frame, hooks, region, replay, verify,
reentrant, group. Nothing here is public API; ``remat/__init__.py`` re-exports
what is."""
