"""Which keys' segments a query sees: the rule every attention kernel shares.

A segment id s >= `BRANCHES` is branch s % BRANCHES of group s // BRANCHES, and the
group's branch 0 (id group x BRANCHES) is a prefix each of its branches sees, as if the
branch continued it alone: how packed RL rows compute each group's prompt once
(`gpurl.data.packing`). Ids below `BRANCHES` (padding 0, SFT packs 1.., cache slots) have
no prefix, so for them the rule is the plain same-segment one.
"""

from __future__ import annotations

import jax

# Segment ids of a packed row with shared prefixes: group x BRANCHES + branch.
BRANCHES = 1 << 10


def visible_segments(q_seg: jax.Array, kv_seg: jax.Array) -> jax.Array:
    """Whether a key's segment is visible to a query's (broadcasting): the same segment,
    or the query's group prefix (branch 0 of its group); never segment 0 (padding)."""
    prefix = q_seg - q_seg % BRANCHES
    return ((kv_seg == q_seg) | (kv_seg == prefix)) & (kv_seg != 0)
