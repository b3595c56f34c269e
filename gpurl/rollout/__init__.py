"""Generation: KV-cache sampler, sampling rules, host-side decoding of local rows."""
