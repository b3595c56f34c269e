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
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

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


def _layer_keys(key: str, layers: int) -> list[str]:
    """The per-layer keys of a stacked block leaf ("params.blocks.attn.q" ->
    "params.blocks.0.attn.q", ...); [key] for any other leaf."""
    parts = key.split(".")
    if "blocks" not in parts[:-1] or parts[parts.index("blocks") + 1].isdigit():
        return [key]
    i = parts.index("blocks") + 1
    return [".".join(parts[:i] + [str(layer)] + parts[i:]) for layer in range(layers)]


def _mismatch(stored: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's arrays and the state to restore (a missing key
    or a shape), or None when the checkpoint fits."""
    missing = sorted(set(wanted) - set(stored))
    if missing:
        return f"no array {missing[0]} in the checkpoint"
    for key, x in wanted.items():
        shape = getattr(stored[key], "shape", None)
        if shape is not None and tuple(shape) != tuple(x.shape):
            return f"{key} is {tuple(shape)} in the checkpoint, {tuple(x.shape)} here"
    return None


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        # cleanup_tmp_directories: a save cut short by a crash leaves a temporary directory;
        # it is never read as a checkpoint and is removed when the next run starts.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_flat(state)), meta=ocp.args.JsonSave(meta)))
        self._manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any, shardings: Any) -> tuple[Any, dict]:
        """State with the structure of `abstract_state`, placed with `shardings`. A
        checkpoint of an earlier gpurl, whose layer parameters were one per layer
        ("params.blocks.3.attn.q"), is read layer by layer and stacked."""
        target = _flat(jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_state, shardings))
        stored = self._stored(step)
        per_layer = self._per_layer(stored, target)
        wanted = per_layer or target
        mismatch = _mismatch(stored, wanted) if stored is not None else None
        try:
            if mismatch:  # refused before any read starts: no background read outlives it
                raise ValueError(mismatch)
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(wanted), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError) as e:
            raise ConfigError(
                f"the checkpoint at {self.directory}/{step} was written for another model or "
                f"optimizer ({type(e).__name__}: {str(e).splitlines()[0][:200]}); set a new run.dir, "
                f"or rerun with the config the run was started with ({self.directory.parent}/"
                f"config.yaml).") from e
        flat = restored["state"]
        if per_layer:
            flat = {k: jnp.stack([flat[old] for old in _layer_keys(k, v.shape[0])])
                    if _layer_keys(k, 1) != [k] else flat[k] for k, v in target.items()}
            flat = {k: jax.device_put(v, target[k].sharding) for k, v in flat.items()}
        state = jax.tree.unflatten(jax.tree.structure(abstract_state),
                                   [flat[k] for k in _flat(abstract_state)])
        return state, dict(restored["meta"])

    def _stored(self, step: int) -> dict[str, Any] | None:
        """The stored state's array metadata by key (shape, dtype); None when unreadable."""
        try:
            return dict(self._manager.item_metadata(step)["state"])
        except Exception:  # noqa: BLE001 - no readable metadata: restore as usual
            return None

    def _per_layer(self, stored: dict[str, Any] | None,
                   target: dict[str, Any]) -> dict[str, Any] | None:
        """The target in the per-layer layout of earlier checkpoints, when step holds one."""
        if stored is None:
            return None
        if set(target) <= set(stored) or not any(_layer_keys(k, 1) != [k] for k in target):
            return None
        out = {}
        for key, x in target.items():
            layers = _layer_keys(key, x.shape[0] if x.shape else 1)
            if layers == [key]:
                out[key] = x
                continue
            layer_sharding = NamedSharding(x.sharding.mesh, P(*x.sharding.spec[1:]))
            out.update({k: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=layer_sharding)
                        for k in layers})
        return out if set(out) <= set(stored) else None

    def close(self) -> None:
        self._manager.close()
