"""Where an ``engine: ray`` build runs: a local Ray instance it starts and stops, or a cluster it joins.

- No address (and no ``RAY_ADDRESS``): ``ray.init`` starts a local instance with the build's CPU count
  (``ray_num_cpus``, else every CPU of this machine); it is shut down when the build ends, however it
  ends (an error, Ctrl-C, SIGTERM), so that no ``ray::`` process outlives the build.
- ``auto``, ``HOST:PORT`` or ``ray://HOST:PORT`` (or ``RAY_ADDRESS``): the build joins that cluster and
  leaves it running. An address nobody answers at is one :class:`ConfigError` line naming it.
- A Ray already initialised in this process (a notebook, a test session) is used as it is and left running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass

from thdpack.offline.errors import ConfigError
from thdpack.offline.stages import RayOptions

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RaySession:
    """The Ray instance a build runs on."""

    options: RayOptions
    local: bool  # a local instance started for this build (shut down at its end)
    address: str  # the GCS address
    nodes: int
    cpus: int

    @property
    def actors(self) -> int:
        """Tokenizing actors: ``options.concurrency``, else one per ``cpus_per_actor`` CPUs of the cluster."""
        if self.options.concurrency is not None:
            return self.options.concurrency
        return max(1, int(self.cpus // self.options.cpus_per_actor))

    def describe(self) -> str:
        """``ray: local instance, 2 CPUs`` / ``ray: cluster at ADDRESS, N nodes, M CPUs``."""
        if self.local:
            return f"ray: local instance, {self.cpus} CPUs"
        return f"ray: cluster at {self.address}, {self.nodes} node{'s' * (self.nodes != 1)}, {self.cpus} CPUs"


def import_ray():
    """The ``ray`` module, or a ConfigError saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401 - the tokenizing map's operator
    except ImportError:
        raise ConfigError('engine: ray needs Ray Data: pip install "thdpack[ray]"') from None
    return ray


@contextlib.contextmanager
def ray_session(options: RayOptions, *, debug: bool = False):
    """Yield the :class:`RaySession` of ``options`` (see the module docstring); a local instance it
    started is shut down on leaving, whatever ends the block."""
    ray = import_ray()
    address = options.address or os.environ.get("RAY_ADDRESS") or None
    local = False
    if not ray.is_initialized():
        kwargs = dict(include_dashboard=False, log_to_driver=debug, configure_logging=False,
                      logging_level=logging.INFO if debug else logging.WARNING)
        if address:
            _check_reachable(address)
            try:
                ray.init(address=address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ConfigError(f"ray_address {address}: cannot join the Ray cluster there "
                                  f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        else:
            local = True
            ray.init(num_cpus=options.num_cpus or os.cpu_count() or 1,
                     object_store_memory=None if options.object_store_mb is None else options.object_store_mb << 20,
                     object_spilling_directory=options.spill_dir, **kwargs)
    try:
        _quiet_ray_data(ray, debug)
        resources = ray.cluster_resources()
        session = RaySession(options, local, ray.get_runtime_context().gcs_address,
                             sum(1 for n in ray.nodes() if n.get("Alive")), int(resources.get("CPU", 0)))
        logger.info(session.describe())
        yield session
    finally:
        if local:
            ray.shutdown()


def _check_reachable(address: str) -> None:
    """ConfigError naming ``address`` when nothing accepts a TCP connection there within a few seconds
    (``ray.init`` would otherwise wait for a minute); ``auto`` is left to ``ray.init``."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"ray_address must be auto, HOST:PORT or ray://HOST:PORT, got {address!r}")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ConfigError(f"ray_address {address}: no Ray cluster answers there ({exc.strerror or exc}); "
                          "start one (ray start --head) or leave ray_address unset for a local instance") from None


def _quiet_ray_data(ray, debug: bool) -> None:
    """Ray Data's own progress bars and per-dataset log lines off (the build shows one bar per stage)."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = debug
    ctx.print_on_execution_start = debug
    if not debug:
        logging.getLogger("ray.data").setLevel(logging.WARNING)
