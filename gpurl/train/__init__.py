"""Training: the one loop (`loop`), a stepper per family of algorithms (`sft`, `rl`,
`preference`), the jitted train step and state (`step`), the optimizer, checkpoints, a
run read back (`restore`), metrics sinks and plots."""
