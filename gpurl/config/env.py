"""The schema of the `env` config group (multi-turn environments and tools), re-exported by
`gpurl.config`. A leaf module: it imports only `gpurl.config.checks`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gpurl.config.checks import ConfigError
from gpurl.config.checks import choice as _choice, positive as _positive, tuplify as _tuplify


AGENT = "agent"  # env.name of agents that play through the gateway


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
    # env.name=agent (env=agent): agent code written against the OpenAI API plays each
    # trajectory through gpurl's gateway (docs/agents.md). One of the two:
    agent: Optional[str] = None  # "pkg.module:solve": `async def solve(client, row) -> float | dict`, given an openai.AsyncOpenAI client on the trajectory's own session
    agent_command: Optional[str] = None  # a command line started per trajectory with OPENAI_BASE_URL, OPENAI_API_KEY and GPURL_ROW (the row as JSON, also on stdin) set; its reward is the last line it prints (a number, or JSON with "reward")
    agent_timeout_s: float = 300.0  # wall-clock seconds of one trajectory; past them it ends with env.error_reward
    agent_max_calls: int = 32  # model calls of one trajectory at most
    agent_rows: int = 2  # rows one trajectory may take in the batch: each fork (a call whose history the agent or the template rewrote) starts one; past them the oldest is dropped

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
        agents = (self.agent is not None) + (self.agent_command is not None)
        if self.name == AGENT and agents != 1:
            raise ConfigError("env=agent needs exactly one of env.agent=pkg.module:solve (an "
                              "async function) or env.agent_command='...' (a program).")
        if self.name != AGENT and agents:
            raise ConfigError("env.agent and env.agent_command are read with env=agent "
                              "(env.name=agent); set it or drop them.")
        _positive("env.agent_timeout_s", self.agent_timeout_s)
        _positive("env.agent_max_calls", self.agent_max_calls)
        _positive("env.agent_rows", self.agent_rows)
        if self.tools and self.name is None:
            raise ConfigError("env.tools names tools but env.name is null; choose an "
                              "environment that calls them (e.g. env=tools or env.name=pkg.module:Name).")

    @property
    def on(self) -> bool:
        return self.name is not None

    @property
    def agents(self) -> bool:
        """Whether agent code plays the trajectories (env=agent), not an `Environment`."""
        return self.name == AGENT

    @property
    def rows_per_trajectory(self) -> int:
        """Rows a trajectory takes in the batch: env.agent_rows with agents, else 1."""
        return self.agent_rows if self.agents else 1
