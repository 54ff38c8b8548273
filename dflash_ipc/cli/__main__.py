"""`python -m dflash_ipc.cli`: what every supervised child runs."""

from dflash_ipc.cli import run

run()
