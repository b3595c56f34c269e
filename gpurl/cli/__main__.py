"""`python -m gpurl.cli ...` is `gpurl ...`."""

from gpurl.cli import run

run()
