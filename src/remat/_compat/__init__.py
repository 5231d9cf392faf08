"""The only package that touches torch internals or gates on torch versions.

One module per torch subsystem remat relies on, each the only place that
touches that subsystem's private names. Every function names the private
API it uses, why no public one does the job, and the versions checked.
"Checked" means the test suite passes on those releases: the CI matrix runs
2.4.1, 2.7.1, 2.11.0, 2.13.0 and 2.15.0 (``scripts/test-matrix.sh``).
Version gates for features that need a newer torch live here too, each with
the error the caller raises below it.

Nothing is re-exported here: a caller imports from the module that gates
what it uses (``from remat._compat.dispatch import no_dispatch_modes``).
``import remat`` loads only the modules the checkpoint core uses (the first
six below); the others load their subsystem's private modules on first use.

Modules, in reading order:

* ``autograd``: the autograd engine: backward calls (graph-task ids, exec
  groups, callbacks at their end, checkpoint validity, backward from a
  gradient edge, ``AccumulateGrad``), node sequence numbers, the
  saved-tensor hooks' C bindings, grad mode, version counters and views;
* ``dispatch``: dispatch and modes: ``TorchDispatchMode`` and the operator
  classes, the mode stacks (the user's modes stepped over, a tracer's modes
  told apart), dispatch-key guards and detaching, operator schemas, the
  wrapper-subclass protocol;
* ``pytree``: flattening nested containers with torch's pytree registry;
* ``devices``: whether a device backend has a context, and the active
  ``with torch.device(...)`` mode;
* ``tracers``: what a region's hooks may run under: functorch's transforms,
  compiled autograd, AOTAutograd inlining saved-tensor hooks into compiled
  graphs, and running a hook, or the eager engine, as plain Python under
  Dynamo;
* ``pipelining``: the pipeline stage a region's forward runs in, and routing
  that stage's backward calls (``torch.distributed.pipelining``'s private
  stage methods; nothing is imported from torch until a stage exists);
* ``versions``: version gates, facts about the installed torch read once;
* ``modules``: ``nn.Module``'s state-dict hooks on torch 2.4 and the compiled
  call ``Module.compile()`` stores;
* ``dynamo``: Dynamo's recompile limit and the errors torch.compile raises;
* ``partitioner``: the min-cut partitioner's settings and per-region
  activation memory budgets;
* ``inductor``: inductor's front end with remat's inner compiler, and its
  buffer plan for one graph (read by ``remat.memory._buffer_plan``);
* ``fake``: fake tensors and their modes;
* ``distributed``: ranks, FSDP2's public API, a simulated process group,
  collectives on fake tensors;
* ``profiler``: the allocations and frees a memory profile saw; profiler labels
  run below every dispatch mode (``labels_unseen``).
"""
