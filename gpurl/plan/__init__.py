"""Ahead-of-time plans of a run's programs: the records the steppers hand over
(`programs`: kind, jitted function, abstract arguments, unit of work), their memory per
device and the advice when one does not fit (`memory`), and the GPU compiler's account of
each against its ideal (`account` reads the optimized module, `efficiency` sets it beside
the ideal and bounds an RL step's tokens/s). `gpurl.train.fitting` builds the run with the
trainer's own builders and fits its `auto` keys with them."""
