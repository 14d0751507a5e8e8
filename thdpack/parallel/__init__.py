"""Index arithmetic of context parallelism: the dual-chunk split and each rank's positions."""
