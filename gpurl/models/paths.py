"""Parameter paths: "blocks/mlp/up" names one leaf of a parameter tree (the up projection of
every layer: block parameters are stacked on a leading layers axis).

`optim.freeze`, `model.lora.targets`, LoRA's frozen base and the optimizer-state shardings
all select parameters by these paths.
"""

from __future__ import annotations

from typing import Any, Sequence

# Containers around a model's own tree (PPO's policy and critic, a scalar model's
# backbone): `optim.freeze` patterns match the path inside them, so ^embed$ freezes the
# embedding of every model in the tree.
CONTAINERS = ("policy", "critic", "backbone")


def param_path(path: Sequence[Any]) -> str:
    """"blocks/mlp/up" for a key path of the parameter tree."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def model_path(path: Sequence[Any]) -> str:
    """The parameter's path inside its model: "critic/backbone/embed" -> "embed"."""
    keys = param_path(path).split("/")
    while len(keys) > 1 and keys[0] in CONTAINERS:
        keys = keys[1:]
    return "/".join(keys)
