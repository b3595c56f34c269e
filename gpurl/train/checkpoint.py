"""Orbax checkpoints of the train state plus a JSON record of the loop's position.

Orbax writes each step into a temporary directory and renames it when complete, so a
crash mid-save leaves the previous checkpoint intact; all processes call save/restore
together (each writes and reads only its own shards). Restoring takes the target
shardings, so a state comes back directly into its shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from gpurl.config import ConfigError


def _flat(tree: Any) -> dict[str, Any]:
    """{"params.blocks.0.attn.q": leaf, ...}: a flat, string-keyed view Orbax round-trips
    for any pytree (nnx int keys, optax NamedTuples, dataclasses)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {".".join(_key(k) for k in path): leaf for path, leaf in leaves}


def _key(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        # cleanup_tmp_directories: a save cut short by a crash leaves a temporary directory;
        # it is never read as a checkpoint and is removed when the next run starts.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_flat(state)), meta=ocp.args.JsonSave(meta)))
        self._manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any, shardings: Any) -> tuple[Any, dict]:
        """State with the structure of `abstract_state`, placed with `shardings`."""
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_state, shardings)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_flat(target)), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError) as e:
            raise ConfigError(
                f"the checkpoint at {self.directory}/{step} was written for another model or "
                f"optimizer ({type(e).__name__}: {str(e).splitlines()[0][:200]}); set a new run.dir, "
                f"or rerun with the config the run was started with ({self.directory.parent}/"
                f"config.yaml).") from e
        flat = restored["state"]
        state = jax.tree.unflatten(jax.tree.structure(abstract_state),
                                   [flat[k] for k in _flat(abstract_state)])
        return state, dict(restored["meta"])

    def close(self) -> None:
        self._manager.close()
