"""GcPolicy: what lived through a freeze is out of every later collection's walk, what is
made after it is collected as before, and cycles the freezes kept are found on request."""

import asyncio
import gc

import pytest

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.gcpolicy import GcPolicy


class Box:
    def __init__(self):
        self.other = None


def cycle() -> Box:
    a, b = Box(), Box()
    a.other, b.other = b, a
    return a


def in_old_generation(obj) -> bool:
    return any(o is obj for o in gc.get_objects(2))


async def test_a_freeze_takes_what_lived_until_then_out_of_full_collections():
    policy = GcPolicy(every_s=0)  # no periodic task: the test freezes when it chooses
    policy.start()
    try:
        kept = Box()
        gc.collect()
        assert in_old_generation(kept)  # survived: a full collection walks it
        before = gc.get_freeze_count()
        policy.freeze()
        assert gc.get_freeze_count() > before and not in_old_generation(kept)
        gc.collect()
        assert not in_old_generation(kept)  # nor does a collection bring it back
        assert policy.freezes == 2  # start-up's and this one
    finally:
        await policy.stop()


async def test_cycles_made_after_a_freeze_are_collected_and_frozen_ones_on_request():
    policy = GcPolicy(every_s=0)
    policy.start()
    try:
        a = cycle()
        policy.freeze()
        del a  # garbage now, but frozen: no collection looks at it
        fresh = cycle()
        del fresh
        assert gc.collect() >= 2  # the cycle made after the freeze
        assert gc.collect() == 0
        found = policy.collect_frozen()
        assert found["unreachable_found"] >= 2 and found["frozen_objects"] > 0 and found["pause_ms"] >= 0
        assert gc.get_freeze_count() > 0  # frozen again afterwards
        status = policy.status()
        assert status["collections"]["gen2"] >= 2 and status["longest_pause_ms"]["gen2"] > 0
    finally:
        await policy.stop()
    assert policy._on_gc not in gc.callbacks


async def test_the_periodic_freeze_runs_on_the_loop():
    policy = GcPolicy(every_s=0.001)
    policy.start()
    try:
        kept = Box()
        gc.collect()
        assert in_old_generation(kept)

        async def second_freeze():
            while policy.freezes < 2:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(second_freeze(), timeout=10)  # the task's, not the test's
        assert not in_old_generation(kept)
    finally:
        await policy.stop()


def test_a_negative_interval_is_named(tmp_path):
    with pytest.raises(ValueError, match="gc_freeze_every_s"):
        GcPolicy(every_s=-1)
    with pytest.raises(ValueError, match="gc_freeze_every_s must be >= 0"):
        CoordinatorConfig(run_dir=tmp_path, model_dir=tmp_path, gc_freeze_every_s=-1)
