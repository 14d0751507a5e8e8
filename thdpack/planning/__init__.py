"""Which samples share a pack, from lengths alone: the packing core, the planners, their kernels and the balancer over data-parallel ranks."""
