"""Generation: the rollout engine (continuous batching over decode slots, a paged KV
cache: `engine`), its sampling rules (`sampling`), the static sampler kept as the tests'
reference (`sampler`), prompts as token ids, per-shard scoring (`scoring`), RL rounds and
evaluation (`rounds`), and one RL step's rounds and trainer batch (`collect`)."""
