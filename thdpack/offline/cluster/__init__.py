"""``engine: ray``: a build's tokenizing and pack writing on a Ray cluster, its plan on the driver.

- :mod:`~thdpack.offline.cluster.ray_session`: start a local Ray instance or join a cluster, say where
  the build runs, shut a local instance down however the build ends.
- :mod:`~thdpack.offline.cluster.ray_map`: the tokenizing map on a pool of Ray actors (one per
  CPU, the row tokenizer loaded once per actor), the same rows and files as the local map.
- :mod:`~thdpack.offline.cluster.ray_write`: the data files written by Ray tasks, one file each.

Only file paths, row counts and per-file results pass between the driver and the workers: the
workers read the rows and write the tokenized rows and the packs in the build's temporary directory,
which must lie on a file system every node reaches (docs/distributed.md).
"""
