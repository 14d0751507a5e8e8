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
import signal
import socket
import threading
from dataclasses import dataclass

from thdpack.offline.errors import ConfigError
from thdpack.offline.stage_options import RayOptions

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 5.0
# a local instance's workers are the build's own processes: they run at the driver's priority, as the local
# engine's workers do (Ray lowers its workers' priority by 15 by default: on a shared machine they would yield
# to every other process, and the build with them)
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0}


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
    except ImportError:
        raise ConfigError('engine: ray needs Ray: pip install "thdpack[ray]"') from None
    return ray


@contextlib.contextmanager
def ray_session(options: RayOptions, *, debug: bool = False):
    """Yield the :class:`RaySession` of ``options`` (see the module docstring); a local instance it
    started is shut down on leaving, whatever ends the block."""
    ray = import_ray()
    address = options.address or os.environ.get("RAY_ADDRESS") or None
    local = False
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if options.address not in (None, "auto") and options.address.split("://", 1)[-1] != current:
            raise ConfigError(f"ray_address {options.address}: this process is already connected to the Ray "
                              f"instance at {current}; leave ray_address unset to use it")
    else:
        kwargs = dict(include_dashboard=False, log_to_driver=debug, configure_logging=False,
                      logging_level=logging.INFO if debug else logging.WARNING)
        if address:
            _check_reachable(address)
            _token_auth_when_available(address)
            try:
                with _keep_signal_handlers():
                    ray.init(address=address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ConfigError(f"ray_address {address}: cannot join the Ray cluster there "
                                  f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        else:
            local = True
            with _keep_signal_handlers():
                ray.init(num_cpus=options.num_cpus or os.cpu_count() or 1,
                         object_store_memory=None if options.object_store_mb is None else options.object_store_mb << 20,
                         object_spilling_directory=options.spill_dir, _system_config=LOCAL_SYSTEM_CONFIG, **kwargs)
    try:
        resources = ray.cluster_resources()
        session = RaySession(options, local, ray.get_runtime_context().gcs_address,
                             sum(1 for n in ray.nodes() if n.get("Alive")), int(resources.get("CPU", 0)))
        logger.info(session.describe())
        yield session
        logger.info(f"ray: driver peak memory {_peak_rss_mb():.0f} MB")
    finally:
        if local:
            ray.shutdown()


def _token_auth_when_available(address: str) -> None:
    """Send this machine's Ray token when joining ``address``: Ray 2.60's ``ray start`` turns token
    authentication on, but ``ray.init(address=HOST:PORT)`` sends a token only under ``RAY_AUTH_MODE=token``
    (it looks for one by itself only for ``auto``). With ``RAY_AUTH_MODE`` unset and a token at hand
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), Ray's own step for ``auto`` is taken
    (token mode for this process); ``RAY_AUTH_MODE=disabled`` joins a cluster without authentication."""
    if address == "auto":
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


@contextlib.contextmanager
def _keep_signal_handlers():
    """Put back this process's SIGINT / SIGTERM handlers after ``ray.init``: Ray 2.60's ``init`` installs a
    SIGTERM handler of its own in the driver (``sys.exit``, and its core prints a stack), which would
    bypass the build's clean stop (exit 143, temporary directory removed) and stays installed after
    ``ray.shutdown``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)


def _peak_rss_mb() -> float:
    """This process's peak resident memory in MB (Linux reports ``ru_maxrss`` in kB, macOS in bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


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
