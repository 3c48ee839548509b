"""solosave's benchmarks: ``python -m benchmarks`` (or ``make bench``) from the repository root.

One command runs, side by side in one run:

* the **save benchmark** (:mod:`benchmarks.save_modes`): stock ``torch.distributed.checkpoint``
  (``save``; ``async_save`` with the thread and the process executor, each with and without
  ``DefaultSavePlanner(enable_plan_caching=True)``; ``async_save(use_collectives=False)``) and
  solosave's three paths (collective; constant structure, whose first save's metadata is
  kept in memory for reuse; create+reuse with a prepared file) on 2 and 4 local gloo ranks,
  with the machine's physical limits (memcpy, sequential write + fsync) measured in the same run;
  collectives are counted in every process by :file:`benchmarks/wrap_dist/sitecustomize.py`;
* the **scale simulation** (:mod:`benchmarks.scale`): the coordinator's work and the bytes of one
  save for W = 2 ... 16384 simulated ranks, stock DCP against solosave's collective and reuse
  paths, in one process.

Output: tables on the terminal, ``<out>/benchmarks.json`` and PNG plots
(:mod:`benchmarks.report`). ``--quick`` is a smoke run of about two minutes; ``--only save`` /
``--only scale`` run one part. Results and their meaning: ``docs/benchmarks.md``.
"""
