"""The scheduler's one-tick decisions (schedule.py) over hand-built states, and the
properties every decision keeps over generated ones."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.coordinator.schedule import BatchView, State, decide, target_roles, topup

R, T = "rollout", "training"


def state(roles, **kw) -> State:
    base = dict(policy="elastic", capacity=(10,) * len(roles), queued=0, running=0, ready_groups=0,
                groups_per_step=2, mu=2, steps=10, steps_done=0, steps_in_burst=0)
    base.update(kw)
    return State(roles=tuple(roles), **base)


def batch(members, *, window_open=True, unclaimed=1, pending=False, packing_done=False) -> BatchView:
    return BatchView(members=tuple(members), window_open=window_open, unclaimed=unclaimed, pending=pending,
                     packing_done=packing_done)


def test_launches_fill_serving_slots_only():
    assert decide(state([R, R, R], queued=50, running=5)).launch == 25
    assert decide(state([R, R, R], queued=3, running=5)).launch == 3
    # A cell switching or dead serves nothing; a standalone pool does.
    d = decide(state([R, R, R], queued=50, running=5, switching=frozenset({1}), dead=frozenset({2}), standalone=4))
    assert d.launch == 9
    assert decide(state([R, R], queued=50, steps_done=10)).launch == 0  # the last step is done


def test_publication_at_burst_end_holds_the_core_not_the_satellites():
    s = state([T, T, T], steps_in_burst=2, mu=2, ready_groups=3)
    d = decide(s)
    assert d.publish and not d.start_step
    assert dict(d.switches) == {1: R, 2: R}  # the satellites go back while the core publishes
    assert not decide(state([T, R], steps_in_burst=2, batch=batch([0]))).publish  # a step in flight
    assert not decide(state([T, R], steps_in_burst=2, switching=frozenset({0}))).publish
    assert not decide(state([T, R], steps_in_burst=2, transfer=True)).publish
    assert decide(state([T, R], steps_done=10, steps=10, steps_in_burst=1, mu=3)).publish  # the last, short burst


def test_colocate_switches_every_cell_at_once_and_starts_only_when_all_arrived():
    s = state([R, R, R], policy="colocate", ready_groups=2)
    assert decide(s).switches == ((0, T), (1, T), (2, T))
    arriving = state([T, T, T], policy="colocate", ready_groups=2, switching=frozenset({2}))
    assert decide(arriving).start_step == ()  # cell 2 is still on its way
    assert decide(state([T, T, T], policy="colocate", ready_groups=2)).start_step == (0, 1, 2)
    assert decide(state([T, T, T], policy="colocate", ready_groups=1, queued=0)).start_step == ()


def test_one_cell_switching_does_not_hold_the_others():
    s = state([R, R, R], policy="colocate", ready_groups=2, switching=frozenset({1}))
    assert decide(s).switches == ((0, T), (2, T))
    busy = state([T, T, T], steps_in_burst=2, mu=2, busy=frozenset({1}))
    assert dict(decide(busy).switches) == {2: R}


def test_readiness_full_batch_or_streaming():
    for policy, need in (("async", 2), ("async-streaming", 1), ("colocate", 2), ("elastic", 1)):
        roles = [T, R] if policy != "colocate" else [T, T]
        assert decide(state(roles, policy=policy, ready_groups=need)).start_step, policy
        if need > 1:
            assert not decide(state(roles, policy=policy, ready_groups=need - 1)).start_step, policy


def test_joins_in_prefix_order_while_the_window_is_open():
    s = state([T, T, T, R], batch=batch([0]), queued=0, running=0)
    assert decide(s).joins == (1, 2)
    gap = state([T, T, T, R], batch=batch([0]), switching=frozenset({1}))
    assert decide(gap).joins == ()  # cell 2 waits for cell 1: members stay a prefix
    assert decide(state([T, T, R], batch=batch([0], window_open=False))).joins == ()
    assert decide(state([T, T, R], batch=batch([0, 1]))).joins == ()


def test_a_gap_sends_the_later_training_cells_back():
    """The core left while satellites were still switching to training: they go back once
    they arrive, and nothing trains across the gap."""
    s = state([R, T, T, R], switching=frozenset({1, 2}), ready_groups=0, running=30)
    assert target_roles(s) == [R, R, R, R]
    arrived = state([R, T, T, R], ready_groups=0, running=30)
    d = decide(arrived)
    assert dict(d.switches) == {1: R, 2: R} and not d.start_step


def test_dead_and_rejoined_cells_stay_out_of_training():
    s = state([R, R, R], policy="colocate", ready_groups=2, dead=frozenset({1}))
    d = decide(s)
    assert d.switches == ((0, T),)  # cell 1 keeps its role; cell 2 is after the gap: rollout only
    s = state([R, R, R], policy="colocate", ready_groups=2, no_reducer=frozenset({0}))
    assert decide(s).switches == ()


def test_a_starving_batch_pauses_and_resumes():
    starving = state([T, T], policy="colocate", queued=4, running=0, batch=batch([0, 1], unclaimed=1))
    assert dict(decide(starving).switches) == {0: R, 1: R}
    paused = state([R, R], policy="colocate", queued=0, running=3, batch=batch([0, 1], pending=True, unclaimed=2))
    assert decide(paused).switches == ()  # work to do, but resuming would leave 3 executions no slot
    ready = state([R, R], policy="colocate", queued=0, running=0, batch=batch([0, 1], pending=True, unclaimed=2))
    assert dict(decide(ready).switches) == {0: T, 1: T}


def test_done_only_when_nothing_is_in_flight():
    assert decide(state([T, R], steps_done=10, steps=10)).done
    assert not decide(state([T, R], steps_done=10, steps=10, steps_in_burst=1)).done  # the last publication
    assert not decide(state([T, R], steps_done=10, steps=10, switching=frozenset({1}))).done
    assert not decide(state([T, R], steps_done=9, steps=10)).done


def test_topup_keeps_phi_plus_mu_batches_dispatched():
    assert [topup(0.5, 3, 4, p) for p in (1, 2, 3)] == [12, 12, 12]
    assert sum(topup(0.25, 1, 4, p) for p in range(1, 5)) == 16


# --- properties over generated states ---------------------------------------------------------


@st.composite
def states(draw):
    n = draw(st.integers(1, 6))
    policy = draw(st.sampled_from(["elastic", "colocate", "async", "async-streaming"]))
    roles = draw(st.lists(st.sampled_from([R, T]), min_size=n, max_size=n))
    cells = st.frozensets(st.integers(0, n - 1), max_size=n)
    dead, switching, busy, no_reducer = draw(cells), draw(cells), draw(cells), draw(cells)
    b = None
    if draw(st.booleans()):
        m = draw(st.integers(1, n))
        b = BatchView(members=tuple(range(m)), window_open=draw(st.booleans()), unclaimed=draw(st.integers(0, 4)),
                      pending=draw(st.booleans()), packing_done=draw(st.booleans()))
    steps = draw(st.integers(1, 5))
    mu = draw(st.integers(1, 3))
    return State(policy=policy, roles=tuple(roles), capacity=tuple(draw(st.lists(st.integers(0, 8), min_size=n,
                                                                                  max_size=n))),
                 queued=draw(st.integers(0, 30)), running=draw(st.integers(0, 30)),
                 ready_groups=draw(st.integers(0, 5)), groups_per_step=draw(st.integers(1, 4)), mu=mu, steps=steps,
                 steps_done=draw(st.integers(0, steps)), steps_in_burst=draw(st.integers(0, mu)),
                 async_training_cells=draw(st.integers(1, n)), switching=switching, busy=busy, dead=dead,
                 no_reducer=no_reducer, standalone=draw(st.integers(0, 6)), batch=b, transfer=draw(st.booleans()))


@settings(max_examples=800, deadline=None)
@given(s=states())
def test_decisions_keep_the_rules(s):
    d = decide(s)
    held = s.switching | s.busy | s.dead
    assert not any(c in held for c, _ in d.switches)  # a cell mid-switch, busy or dead is never moved
    assert all(s.roles[c] != role for c, role in d.switches)
    if s.transfer or d.publish:
        assert 0 not in dict(d.switches)  # the core stays while weights move
    assert 0 <= d.launch <= s.queued
    if d.launch:
        serving = s.standalone + sum(cap for c, (cap, r) in enumerate(zip(s.capacity, s.roles))
                                     if r == R and c not in s.switching and c not in s.dead)
        assert s.running + d.launch <= serving
    if d.start_step:  # a prefix of settled training cells, never with a batch in flight or weights moving
        assert s.batch is None and not s.transfer and not d.publish
        assert d.start_step == tuple(range(len(d.start_step)))
        assert all(s.roles[c] == T and c not in s.switching and c not in s.dead and c not in s.no_reducer
                   for c in d.start_step)
    if d.joins:  # contiguous after the members, settled training cells
        assert s.batch is not None and s.batch.window_open
        first = len(s.batch.members)
        assert d.joins == tuple(range(first, first + len(d.joins)))
        assert all(s.roles[c] == T and c not in s.switching for c in d.joins)
    want = target_roles(s)
    k = next((c for c in range(s.cells) if c in s.dead or c in s.no_reducer), s.cells)
    trains = [want[c] == T for c in range(k)]
    assert all(trains[:sum(trains)]), (want, s)  # training stays a prefix
    assert all(want[c] == R for c in range(k, s.cells) if c not in s.dead)  # after a gap: rollout only
