"""One commit per Hub id for the whole job.

Each host has its own Hugging Face cache, and a name such as `org/name` resolves to the
commit its cache's `refs/main` holds (offline) or to the Hub's default branch at that
moment (online, and a push can land while the job starts). Two processes resolving on
their own could load different weights, or score different suite rows, while config.yaml
recorded one commit. Here process 0 resolves the id, every process is sent that commit
(`host.gather_text`) and reads exactly it, fetching it when online; a process that cannot
read it stops the whole job with one sentence, on every process.
"""

from __future__ import annotations

from gpurl import hub
from gpurl.config import ConfigError
from gpurl.distributed import host, runtime

_FAILED = "\0failed: "


def agreed_pin(value: str, key: str, kind: str = "model_meta", local: str | None = None) -> str:
    """`value` as `org/name@<commit>`, the commit process 0 resolves it to, on every
    process (anything but a Hub id unchanged); `key` names the setting in errors, `kind`
    the files needed (`hub.FILES`) and `local` the errors' alternative to the Hub."""
    if not hub.is_hub_id(value):
        return value
    if runtime.process_count() == 1:
        return hub.pinned(value, key, kind, local)
    first = _attempt(value, key, kind, local) if runtime.process_index() == 0 else ""
    first = host.gather_text(first)[0]
    if first.startswith(_FAILED):  # process 0 could not resolve it: its own sentence
        raise ConfigError(first[len(_FAILED):])
    mine = first if runtime.process_index() == 0 else _attempt(first, key, kind, local)
    problems = [(p, text[len(_FAILED):]) for p, text in enumerate(host.gather_text(mine))
                if text.startswith(_FAILED)]
    if problems:
        p, reason = problems[0]
        raise ConfigError(
            f"{key}={value} resolves to {first} on process 0, which process {p} cannot read "
            f"({reason.rstrip('.')}); give every process the same Hugging Face cache, or "
            f"fetch {first} into each host's cache.")
    return first


def _attempt(value: str, key: str, kind: str, local: str | None) -> str:
    """The pinned id, or the sentence that says why not (marked `_FAILED`)."""
    try:
        return hub.pinned(value, key, kind, local)
    except ConfigError as e:
        return _FAILED + str(e)
