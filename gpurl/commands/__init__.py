"""The commands above training: `gpurl generate`, `gpurl eval` and `gpurl export`, each a
thin layer over `gpurl.rollout` and `gpurl.train` (a run's checkpoint read back)."""
