"""Process start-up: the one place that calls `jax.distributed.initialize`.

Single process: nothing to do. In a Slurm job step of several tasks (`srun`) or with explicit
`distributed.*` keys: join the job. On CPU the gloo collectives are selected so the same
multi-process code runs in tests.
"""

from __future__ import annotations

import os
import socket
import time

import jax

from gpurl.config import ConfigError, DistributedConfig

_initialized = False


def wants_multiprocess(cfg: DistributedConfig) -> bool:
    """Explicit `distributed.*` keys, or a Slurm job step (`srun`) of several tasks."""
    if (cfg.num_processes or 1) > 1 and cfg.coordinator is None and not _cluster():
        raise ConfigError(
            f"distributed.num_processes={cfg.num_processes} outside Slurm needs "
            f"distributed.coordinator=HOST:PORT (process 0's address) and "
            f"distributed.process_id on every process; set both, or start the job with srun.")
    if cfg.coordinator is not None or (cfg.num_processes or 1) > 1:
        return True
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        return True
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_NUM_TASKS" not in os.environ:
        # Inside an sbatch/salloc allocation but not in a job step: one process would run
        # alone while the job expects several.
        raise ConfigError(
            f"this is a Slurm allocation of {os.environ['SLURM_NTASKS']} tasks but gpurl was "
            f"not started by srun; launch it as `srun gpurl train ...` (one task per GPU).")
    return False


# Environments in which jax.distributed finds the coordinator by itself (its cluster
# detection): Slurm, Open MPI, Kubernetes.
_CLUSTER_VARIABLES = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE",
                      "KUBERNETES_SERVICE_HOST")


def _cluster() -> bool:
    return any(name in os.environ for name in _CLUSTER_VARIABLES)


def job_shape() -> tuple[int, int]:
    """(processes, devices of this process) of the job this process is in."""
    return jax.process_count(), jax.local_device_count()


def initialize(cfg: DistributedConfig) -> None:
    """Joins the multi-process job if there is one; prints one start-up line per process."""
    global _initialized
    if _initialized:
        return
    _initialized = True
    if wants_multiprocess(cfg):
        if cfg.coordinator is not None and (cfg.num_processes is None or cfg.process_id is None):
            raise ConfigError(
                "distributed.coordinator is set without distributed.num_processes and "
                "distributed.process_id; set all three (or none under Slurm).")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if cfg.coordinator is not None and cfg.process_id != 0:
            _wait_for_coordinator(cfg.coordinator, cfg.init_timeout_s)
        try:
            jax.distributed.initialize(
                coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                process_id=cfg.process_id, initialization_timeout=cfg.init_timeout_s,
                heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
                shutdown_timeout_seconds=cfg.shutdown_timeout_s)
        except Exception as e:  # noqa: BLE001 - XLA raises several runtime error types
            where = cfg.coordinator or "the address Slurm gives"
            raise ConfigError(
                f"could not join the job through the coordinator at {where} within "
                f"{cfg.init_timeout_s} s ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                f"check distributed.coordinator and that every process of the job started."
            ) from None
    print(f"[gpurl] process {jax.process_index()}/{jax.process_count()} "
          f"backend={jax.default_backend()} local_devices={jax.local_device_count()} "
          f"global_devices={jax.device_count()}", flush=True)


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Process 0 hosts the coordinator; the others wait for its port (bounded), so an
    unreachable address ends with one sentence instead of XLA's abort after the timeout."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"distributed.coordinator={address!r} is not host:port; write it "
                          f"like 10.0.0.1:1234.")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"could not reach the coordinator at {address} within {timeout_s} s; check "
                    f"distributed.coordinator and that process 0 of the job is running.") from None
            time.sleep(0.5)


def is_main_process() -> bool:
    return jax.process_index() == 0


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()
