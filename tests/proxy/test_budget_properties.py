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


# Several executions: a step is (what, which execution).
MANY = st.lists(st.tuples(st.sampled_from(["admit", "release", "cancel", "run"]), st.integers(0, 2)),
                min_size=1, max_size=80)


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(1, 6), steps=MANY)
def test_executions_calling_together_share_the_slots_fairly_and_none_is_lost(cap, steps):
    """Beside others, an execution holds at most max(1, cap // n) of the n calling; a slot
    freed is never left idle while an execution under its share waits; each execution's
    waiters are served oldest first; every slot comes back."""
    async def scenario() -> None:
        budgets = Budgets(max_in_flight=cap, wait_s=3600.0)
        names = ["a", "b", "c"]
        admitted: dict[str, list[int]] = {n: [] for n in names}
        waiting: dict[str, dict[int, asyncio.Task]] = {n: {} for n in names}
        arrival = 0

        async def call(name: str, n: int) -> None:
            await budgets.admit(name)
            admitted[name].append(n)

        async def settle() -> None:
            for _ in range(8):
                await asyncio.sleep(0)
            for name in names:
                for n, task in list(waiting[name].items()):
                    if task.done():
                        del waiting[name][n]

        for step, which in steps:
            name = names[which]
            if step == "admit":
                waiting[name][arrival] = asyncio.create_task(call(name, arrival))
                arrival += 1
            elif step == "release" and admitted[name]:
                admitted[name].pop(0)
                budgets.release(name)
            elif step == "cancel" and waiting[name]:
                waiting[name].pop(min(waiting[name])).cancel()
            elif step == "run":
                await settle()
                calling = [n for n in names if admitted[n] or waiting[n]]
                share = cap if len(calling) <= 1 else max(1, cap // len(calling))
                for n in names:
                    assert budgets.in_flight(n) == len(admitted[n]), (n, budgets.in_flight(n), admitted)
                    # Work-conserving: nobody waits while under the share.
                    assert not waiting[n] or len(admitted[n]) >= share, (n, share, admitted, waiting)
                    assert all(m > k for m in waiting[n] for k in admitted[n])  # oldest first
            for n in names:
                assert 0 <= budgets.in_flight(n) <= cap
        await settle()
        for name in names:
            for task in waiting[name].values():
                task.cancel()
        await settle()
        for name in names:
            while admitted[name]:
                admitted[name].pop(0)
                budgets.release(name)
                await settle()
            assert budgets.in_flight(name) == 0
        assert budgets.share_now() == cap  # nobody calls: the whole budget is one execution's again

    asyncio.run(scenario())


def test_a_flooder_gives_way_to_a_neighbour_and_has_its_whole_budget_back_once_it_leaves():
    async def scenario() -> None:
        budgets = Budgets(max_in_flight=4, wait_s=3600.0)
        for _ in range(4):
            await budgets.admit("flooder")  # alone: all four
        extra = [asyncio.create_task(budgets.admit("flooder")) for _ in range(3)]
        await asyncio.wait_for(budgets.admit("neighbour"), 1)  # at once, though the flooder is full
        assert budgets.share_now() == 2
        for _ in range(2):
            budgets.release("flooder")
        await _run_loop()
        assert budgets.in_flight("flooder") == 2 and not any(t.done() for t in extra)  # at its share: waits
        budgets.release("flooder")
        await _run_loop()
        assert budgets.in_flight("flooder") == 2 and sum(t.done() for t in extra) == 1
        budgets.release("neighbour")  # the neighbour stops calling: the flooder's share is 4 again
        await _run_loop()
        assert all(t.done() for t in extra) and budgets.in_flight("flooder") == 4

    asyncio.run(scenario())


async def _run_loop() -> None:
    for _ in range(8):  # whatever was handed a slot proceeds
        await asyncio.sleep(0)
