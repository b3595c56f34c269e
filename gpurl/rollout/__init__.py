"""Generation: the KV-cache sampler and its sampling rules, prompts as token ids, per-shard
scoring (`scoring`), the rollout engine that samples and scores (`engine`), and one RL
step's rounds and trainer batch (`collect`)."""
