"""Multi-turn environments and tools for RL (`env=` on the command line).

An environment is built per trajectory from its data row, `Name(prompt, **metadata)`;
`reset()` may add an observation before the first model turn and `step(action_text)`
answers each model turn with `Step(observation, reward, done)`. Tools are plain Python
callables with a JSON schema; a `ToolEnvironment` calls them when the model writes a tool
call in the configured format (`gpurl.envs.formats`). The rollout steps every
environment on the host of the process that holds its row (`gpurl.rollout.multiturn`).
"""

from gpurl.envs.base import Environment, EnvError, Step
from gpurl.envs.builtin import resolve
from gpurl.envs.tools import Tool, ToolEnvironment, load_tools

__all__ = ["Environment", "EnvError", "Step", "Tool", "ToolEnvironment", "load_tools", "resolve"]
