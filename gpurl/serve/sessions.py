"""An agent trajectory's token history on the gateway, kept exact (plain Python: no JAX,
no HTTP).

A session is one trajectory. Each call brings the context its messages render to
(`gpurl.serve.chat.Renderer`: every assistant message the session sampled spliced back as
its sampled ids). The fork rule:

- the context extends the current row's tokens (append-only history): the row grows by
  the context's new tokens (observations: tool results, user turns; never trained) and
  then by the tokens sampled for the call (trained, with their sampler log-probs);
- otherwise the agent or the template rewrote the history (edited or dropped a message, a
  template that drops earlier `<think>` blocks): the current row is closed and a new row
  starts with the whole context. Each row's tokens are exactly what was fed and sampled.

A trajectory keeps at most `max_rows` rows: a fork past them drops the oldest row (its
tokens are not trained; counted in `dropped`), so the rows kept are always the latest,
the one holding the final answer among them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence


@dataclass
class Row:
    """One row of a trajectory: `context` tokens first (its start), then sampled and
    appended tokens in order; `sampled` marks the model's own."""

    tokens: list[int]
    sampled: list[bool]
    logprobs: list[float]
    versions: list[int]
    context: int  # the tokens of the context the row started from

    @classmethod
    def start(cls, context: Sequence[int]) -> Row:
        n = len(context)
        return cls(list(context), [False] * n, [0.0] * n, [-1] * n, n)

    def append(self, tokens: Sequence[int], sampled: bool, logprobs: Sequence[float] = (),
               versions: Sequence[int] = ()) -> None:
        n = len(tokens)
        self.tokens += list(tokens)
        self.sampled += [sampled] * n
        self.logprobs += list(logprobs) if sampled else [0.0] * n
        self.versions += list(versions) if sampled else [-1] * n


@dataclass
class Session:
    """One trajectory's rows and counts (`extend` before a call, `sample` after it)."""

    max_rows: int = 4
    rows: list[Row] = field(default_factory=list)
    calls: int = 0
    forks: int = 0
    dropped: int = 0  # rows dropped past max_rows
    prefilled: int = 0  # context tokens the calls added (what a prefix cache must prefill)

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    def extend(self, context: Sequence[int]) -> bool:
        """The history before a call whose messages render to `context`: the current row
        grown by it (True), or a new row from it when it does not extend the row (False,
        a fork; the first call's row is no fork)."""
        self.calls += 1
        row = self.rows[-1] if self.rows else None
        if row is not None and len(context) >= len(row.tokens) and list(
                context[:len(row.tokens)]) == row.tokens:
            added = context[len(row.tokens):]
            row.append(added, sampled=False)
            self.prefilled += len(added)
            return True
        if row is not None:
            self.forks += 1
        self.rows.append(Row.start(context))
        self.prefilled += len(context)
        if len(self.rows) > self.max_rows:
            self.rows.pop(0)
            self.dropped += 1
        return row is None

    def sample(self, tokens: Sequence[int], logprobs: Sequence[float],
               versions: Sequence[int] = ()) -> None:
        """The tokens sampled for the call, after the context `extend` gave."""
        self.rows[-1].append(tokens, True, logprobs, versions or [0] * len(tokens))

    def context(self) -> list[int]:
        """The current row's tokens: what the next call's prompt is, when it extends."""
        return list(self.rows[-1].tokens) if self.rows else []

    def versions(self) -> list[int]:
        """The policy version of each model token its rows hold."""
        return [v for r in self.rows for v, s in zip(r.versions, r.sampled) if s]

    def state(self) -> dict:
        """The session as plain data (a checkpoint's), `from_state` rebuilds it."""
        return asdict(self)

    @classmethod
    def from_state(cls, data: dict) -> Session:
        return cls(**{**data, "rows": [Row(**r) for r in data["rows"]]})


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """The length of the longest prefix every token list shares."""
    if not rows:
        return 0
    n = min(len(r) for r in rows)
    first = rows[0]
    for i in range(n):
        if any(r[i] != first[i] for r in rows[1:]):
            return i
    return n
