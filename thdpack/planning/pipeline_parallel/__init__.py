"""A pipeline-parallel step, planned: :mod:`.steps` (``plan_steps``: the micro-batch count, the packs dealt over the
data-parallel ranks, each rank's order) over :mod:`.simulate` (megatron-core's 1F1B and interleaved schedules,
simulated op by op). ``StepPlan`` and ``PipelineShape`` are :mod:`thdpack.planning`'s, ``plan_steps`` is
``thdpack``'s."""
