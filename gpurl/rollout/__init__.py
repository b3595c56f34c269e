"""Generation. The rollout engine, split by job: requests and completions (`requests`), the
KV block pool (`blocks`), the scheduler (`scheduler`, plain Python), the device programs
(`programs`) and the loop that drives them (`engine`); token sampling rules (`sampling`),
the static reference sampler (`static`), prompts as token ids (`prompts`), per-shard
scoring (`scoring`), RL rounds and evaluation (`rounds`), one RL step's rounds and trainer
batch (`collect`), multi-turn trajectories (`multiturn`)."""
