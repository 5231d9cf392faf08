"""The checkpoint core. Nothing here is public API; ``remat/__init__.py`` re-exports what is.

Read in this order (one saved tensor's path through them:
``docs/design/saved-tensor.md``). Where code runs and who watches (the
"inside a region" flag, the base of a region's saved-tensor hooks, the
observers) is :mod:`remat._scope`, below the engine; where a kept tensor lives
(device, host, compressed) is :mod:`remat.storage`, below it too.

1. ``forward_state``: the forward's RNG, autocast and device state, captured
   when a region starts and restored around its recomputation; the
   ``torch.func`` transform it ran under, which a recomputation cannot replay.
2. ``frame``: per-region bookkeeping: the inputs, one ``Holder`` per saved
   tensor, one store of recomputed tensors per backward call.
3. ``hooks``: the region's saved-tensor hooks: ``ForwardHooks.pack`` drops
   every tensor autograd saves (a ``Holder`` instead), the first unpack in
   backward runs ``recompute``, ``RecomputeHooks.pack`` catches what it
   saves; early stop.
4. ``region``: :class:`~remat._engine.region.Region`, ``enter(args, kwargs)``
   and ``exit(exc)``: the one object every front-end drives.
5. ``verify``: the determinism check and the debug log of operators.
6. ``optable``: facts about each operator and a policy's decision for it,
   worked out once and shared (``OpTable.decide``).
7. ``selective``: selective checkpointing: ``RecordOps`` asks the policy for
   each op of the forward and caches what it saves (where it lives:
   :func:`remat.storage.choice.decide`), ``ReplayOps`` serves the cache in
   the recomputation.
8. ``reentrant``: the ``use_reentrant=True`` variant, one autograd node per
   region and a nested backward; its recomputation and double backward.
9. ``reentrant_uses``: what a reentrant region's function uses (the mode,
   ``Record`` in the forward, ``Substitute``'s stand-ins in the
   recomputation) and the node's edges.
10. ``reentrant_edges``: where the nested backward's gradients go, edge by
    edge; custom Functions' edges no stand-in covers.
11. ``group``: ``GraphExecGroup``, one recomputation shared by several
    backward calls.
12. ``split``: a pipeline stage's backward split into an input pass and a
    weight pass: one recomputation per microbatch, keyed by the microbatch
    (``docs/design/pipelining.md``).
13. ``transformed``: a region under ``torch.func``'s grad transform (which
    turns saved-tensor hooks off) run as one recomputing ``autograd.Function``
    with its own vmap and jvp rules (``docs/design/tracing.md``); loaded when
    a transform first needs it.
"""
