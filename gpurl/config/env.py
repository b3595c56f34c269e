"""The schema of the `env` config group (multi-turn environments and tools), re-exported by
`gpurl.config`. A leaf module: it imports only `gpurl.config.checks`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gpurl.config.checks import ConfigError
from gpurl.config.checks import choice as _choice, positive as _positive, tuplify as _tuplify


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn RL: an environment per trajectory (`gpurl.envs`), stepped on the host of
    the process that holds the row, between turns of the rollout engine. Off when `name`
    is null (single-turn completions scored by the reward functions)."""

    # built-in environment (calculator, guess_number) or "pkg.module:Name"; null = single-turn
    name: Optional[str] = None
    # tools the environment may call: built-in names (calculator) or "pkg.module:function"
    tools: list[str] = field(default_factory=list)
    tool_format: str = "hermes"  # tool-call syntax the parser reads: hermes (Qwen 2.5/3 <tool_call>{json}</tool_call>) or llama3 ({"name", "parameters"} JSON)
    max_turns: int = 4  # model turns per trajectory
    max_tokens: int = 256  # tokens after the prompt per trajectory (model and observation tokens): the trainer's completion width
    stop: list[str] = field(default_factory=list)  # strings that end a model turn besides EOS and rollout.stop ("\n" means newline)
    reward: str = "sum"  # trajectory reward from the environment's step rewards: sum or last
    timeout_s: float = 10.0  # seconds one reset or step may take; 0 = no limit
    # an environment or tool that raises or runs past env.timeout_s: end (end that
    # trajectory with env.error_reward, counted in env/errors) or stop (end the run naming it and the row)
    on_error: str = "end"
    error_reward: float = 0.0  # trajectory reward of a trajectory ended by an error

    def __post_init__(self) -> None:
        _tuplify(self)
        object.__setattr__(self, "stop", tuple(
            s.replace("\\n", "\n").replace("\\t", "\t") for s in self.stop))
        if any(s == "" for s in self.stop):
            raise ConfigError("env.stop holds an empty string; remove it or give the text to stop at.")
        _choice("env.tool_format", self.tool_format, ("hermes", "llama3"))
        _choice("env.reward", self.reward, ("sum", "last"))
        _choice("env.on_error", self.on_error, ("end", "stop"))
        _positive("env.max_turns", self.max_turns)
        _positive("env.max_tokens", self.max_tokens)
        _positive("env.timeout_s", self.timeout_s, allow_zero=True)
        if self.tools and self.name is None:
            raise ConfigError("env.tools names tools but env.name is null; choose an "
                              "environment that calls them (e.g. env=tools or env.name=pkg.module:Name).")

    @property
    def on(self) -> bool:
        return self.name is not None
