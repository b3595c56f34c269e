"""`python tests/slow_commit.py train ...`: the `gpurl` command with every Orbax commit held
open, so a test can SIGKILL a run in the middle of writing a checkpoint.

Orbax writes a checkpoint into `<step>.orbax-checkpoint-tmp` and then finalizes it (writes
its commit marker and renames it to `<step>`). Here each finalize first touches
`$GPURL_TEST_COMMIT_DIR/<temporary directory name>` (every array of that directory is on
disk at that moment) and then waits $GPURL_TEST_COMMIT_DELAY_S seconds before committing.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from orbax.checkpoint._src.path import atomicity


def _slow(finalize):
    async def slow_finalize(self, *args, **kwargs):
        (Path(os.environ["GPURL_TEST_COMMIT_DIR"]) / self.get().name).touch()
        await asyncio.sleep(float(os.environ.get("GPURL_TEST_COMMIT_DELAY_S", "2")))
        return await finalize(self, *args, **kwargs)
    return slow_finalize


for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
    cls.finalize = _slow(cls.finalize)

if __name__ == "__main__":
    from gpurl.cli import main

    main()
