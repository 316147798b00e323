"""proxy/budget.py's admission under any interleaving (hypothesis): an execution never holds
more than its calls in flight, a slot is never lost or made up (in flight returns to zero
once every admitted call is released), waiters are served oldest first, and a waiter that
gives up (the client left, or its wait ran out) passes on a slot it was handed."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.proxy.budget import Budgets, OverBudget

# One step: a new call arrives (admit), an admitted call ends (release), a waiting client
# leaves (cancel), or the loop runs (whatever was handed a slot proceeds): between runs,
# releases and cancellations meet waiters that were handed a slot but have not run yet.
STEPS = st.lists(st.sampled_from(["admit", "release", "cancel", "run"]), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(cap=st.integers(1, 4), steps=STEPS)
def test_calls_in_flight_never_exceed_the_cap_and_no_slot_is_lost(cap, steps):
    async def scenario() -> None:
        budgets = Budgets(max_in_flight=cap, wait_s=3600.0)
        admitted: list[int] = []  # calls holding a slot, in the order they got it
        waiting: dict[int, asyncio.Task] = {}
        arrival = 0

        async def call(n: int) -> None:
            await budgets.admit("e")
            admitted.append(n)

        async def settle() -> None:
            for _ in range(5):
                await asyncio.sleep(0)
            for n, task in list(waiting.items()):
                if task.done():
                    del waiting[n]

        for step in steps:
            if step == "admit":
                waiting[arrival] = asyncio.create_task(call(arrival))
                arrival += 1
            elif step == "release" and admitted:
                admitted.pop(0)
                budgets.release("e")
            elif step == "cancel" and waiting:
                # The oldest waiter leaves: it may have been handed a slot by a release this
                # very step, before it ran (then the slot must pass on, not vanish).
                waiting.pop(min(waiting)).cancel()
            elif step == "run":
                await settle()
                assert budgets.in_flight("e") == len(admitted), (budgets.in_flight("e"), admitted)
                # Oldest first: every call still waiting arrived after every call holding a slot.
                assert all(m > n for m in waiting for n in admitted), (sorted(waiting), admitted)
            assert 0 <= budgets.in_flight("e") <= cap
        await settle()
        for task in waiting.values():  # the rest leave; every admitted call ends
            task.cancel()
        await settle()
        assert budgets.in_flight("e") == len(admitted), (budgets.in_flight("e"), admitted)
        while admitted:
            admitted.pop(0)
            budgets.release("e")
            await settle()
        assert budgets.in_flight("e") == 0

    asyncio.run(scenario())


@settings(max_examples=50, deadline=None)
@given(cap=st.integers(1, 3), extra=st.integers(1, 4))
def test_a_wait_that_runs_out_is_a_429_and_leaves_the_slots_whole(cap, extra):
    async def scenario() -> None:
        budgets = Budgets(max_in_flight=cap, wait_s=0.0)
        for _ in range(cap):
            await budgets.admit("e")
        for _ in range(extra):
            try:
                await budgets.admit("e")
            except OverBudget as e:
                assert e.kind == "requests" and e.retry_after_s >= 1
            else:
                raise AssertionError("a call past the cap was let in")
        assert budgets.in_flight("e") == cap and budgets.refused["requests"] == extra
        await budgets.admit("other")  # another execution is not held back by this one
        assert budgets.in_flight("other") == 1
        for _ in range(cap):
            budgets.release("e")
        assert budgets.in_flight("e") == 0

    asyncio.run(scenario())
