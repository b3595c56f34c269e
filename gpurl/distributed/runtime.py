"""Process start-up: the one place that calls `jax.distributed.initialize`.

Single process: nothing to do. Under Slurm (`SLURM_NTASKS` > 1) or with explicit
`distributed.*` keys: join the job. On CPU the gloo collectives are selected so the same
multi-process code runs in tests.
"""

from __future__ import annotations

import os

import jax

from gpurl.config import ConfigError, DistributedConfig

_initialized = False


def _wants_multiprocess(cfg: DistributedConfig) -> bool:
    if cfg.coordinator is not None or (cfg.num_processes or 1) > 1:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1


def initialize(cfg: DistributedConfig) -> None:
    """Joins the multi-process job if there is one; prints one start-up line per process."""
    global _initialized
    if _initialized:
        return
    _initialized = True
    if _wants_multiprocess(cfg):
        if cfg.coordinator is not None and (cfg.num_processes is None or cfg.process_id is None):
            raise ConfigError(
                "distributed.coordinator is set without distributed.num_processes and "
                "distributed.process_id; set all three (or none under Slurm).")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
            process_id=cfg.process_id)
    print(f"[gpurl] process {jax.process_index()}/{jax.process_count()} "
          f"backend={jax.default_backend()} local_devices={jax.local_device_count()} "
          f"global_devices={jax.device_count()}", flush=True)


def is_main_process() -> bool:
    return jax.process_index() == 0


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()
