"""inproc.py: the coordinator tests' default shape, a run whose workers are threads of the test's
process (`workers = "inproc"`, gyre/workerd/inproc.py): no workerd to start, so a run costs its
work, not two interpreter start-ups. What needs processes (signals, a SIGKILLed worker, CURVE,
external workers, netns, megatron's process group) builds `Coordinator(config)` on ZeroMQ instead,
and each converted file keeps a zmq twin of one representative test."""

from __future__ import annotations

import dataclasses

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.main import Coordinator
from gyre.workerd.inproc import InprocWorkers

SET = ("--set", "workers=inproc")  # the same for `gyre up` on the command line


def coordinator(config: CoordinatorConfig, **kw) -> Coordinator:
    """`Coordinator(config, **kw)` with its workers in this process."""
    return Coordinator(dataclasses.replace(config, workers="inproc"), workers=InprocWorkers(), **kw)
