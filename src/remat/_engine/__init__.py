"""The checkpoint core. Nothing here is public API; ``remat/__init__.py`` re-exports what is.

Read in this order (one saved tensor's path through them:
``docs/design/saved-tensor.md``):

1. ``scope``: where code runs and who watches: the "inside a region" flag,
   :class:`~remat._engine.scope.RegionHooks` (the base of a region's
   saved-tensor hooks), ``Nested`` contexts, the saved-tensor observers.
2. ``forward_state``: the forward's RNG, autocast and device state, captured
   when a region starts and restored around its recomputation; the
   ``torch.func`` transform it ran under, which a recomputation cannot replay.
3. ``frame``: per-region bookkeeping: the inputs, one ``Holder`` per saved
   tensor, one store of recomputed tensors per backward call.
4. ``hooks``: the region's saved-tensor hooks: ``ForwardHooks.pack`` drops
   every tensor autograd saves (a ``Holder`` instead), the first unpack in
   backward runs ``recompute``, ``RecomputeHooks.pack`` catches what it
   saves; early stop.
5. ``region``: :class:`~remat._engine.region.Region`, ``enter(args, kwargs)``
   and ``exit(exc)``: the one object every front-end drives.
6. ``verify``: the determinism check and the debug log of operators.
7. ``optable``: facts about each operator and a policy's decision for it,
   worked out once and shared (``OpTable.decide``).
8. ``selective``: selective checkpointing: ``RecordOps`` asks the policy for
   each op of the forward and caches what it saves, ``ReplayOps`` serves the
   cache in the recomputation.
9. ``transfer``: saved tensors kept elsewhere, block by block (``Stash``,
   ``StoredTensor``), and the host one: to host memory and back
   (``HostTransfer``, ``HostCopy``), for offloading policies and the
   ``remat.offload`` context.
10. ``compressed``: the other stash, saved tensors kept smaller on their
    device (``Compressor``), for compressing policies, the ``remat.compress``
    context and a region's ``compress_inputs``.
11. ``copies``: what the transfer needs from a device (streams, events,
    pinned buffers); CUDA's backend.
12. ``simulated``: a device whose copies land late and out of order, for
    testing the transfer on a CPU.
13. ``reentrant``: the ``use_reentrant=True`` variant, one autograd node per
    region and a nested backward; its recomputation and double backward.
14. ``reentrant_uses``: what a reentrant region's function uses (the mode,
    ``Record`` in the forward, ``Substitute``'s stand-ins in the
    recomputation) and the node's edges.
15. ``reentrant_edges``: where the nested backward's gradients go, edge by
    edge; custom Functions' edges no stand-in covers.
16. ``group``: ``GraphExecGroup``, one recomputation shared by several
    backward calls.
"""
