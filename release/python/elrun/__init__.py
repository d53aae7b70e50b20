"""elrun: a torchrun-compatible launcher and elastic job agent.

The wheel installs two native programs onto PATH, `elrun` (the launcher: `elrun --standalone
--nproc-per-node 2 train.py`) and `elrun-rdzv` (the rendezvous daemon for multi-node elastic
jobs), and this package with the Python side of elrun:

    from elrun import heartbeat
    heartbeat.beat(step)          # progress heartbeats for --worker-timeout, goodput, stragglers

`python -m elrun ...` runs the installed `elrun` with the same arguments. Nothing here imports
torch.
"""
import os
import sysconfig

from elrun._version import __version__  # noqa: F401  (written by release/wheel.py)


def program(name="elrun"):
    """The absolute path of an installed program ("elrun" or "elrun-rdzv")."""
    return os.path.join(sysconfig.get_path("scripts"), name)
