"""Placement policies over hand-built snapshots: capacity always covers the waterlevel,
the core moves before satellites, no join after the window closes, bursts end cleanly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.coordinator.policies import POLICIES, Snapshot, async_policy, colocate_policy, elastic_policy

R, T = "rollout", "training"


def snap(roles, **kw):
    base = dict(queued=0, running=0, ready_groups=0, groups_per_step=2, mu=2, steps_in_burst=0,
                step_in_flight=False, capacity=(10,) * len(roles))
    base.update(kw)
    return Snapshot(roles=tuple(roles), **base)


def test_elastic_core_enters_only_with_supply_and_room():
    assert elastic_policy(snap([R, R, R], running=25, ready_groups=1)) == (R, R, R)  # 20 < 25: no room
    assert elastic_policy(snap([R, R, R], running=20, ready_groups=0)) == (R, R, R)  # no supply
    assert elastic_policy(snap([R, R, R], running=20, ready_groups=1)) == (T, R, R)  # core first, alone


def test_elastic_satellites_join_in_order_while_the_window_is_open():
    s = snap([T, R, R], running=5, step_in_flight=True, window_open=True, unclaimed=3)
    assert elastic_policy(s) == (T, T, R)  # cell 2 would leave 0 < 5 capacity
    s = snap([T, R, R], running=0, step_in_flight=True, window_open=True, unclaimed=3)
    assert elastic_policy(s) == (T, T, T)
    closed = snap([T, R, R], running=0, step_in_flight=True, window_open=False, unclaimed=0, ready_groups=5)
    assert elastic_policy(closed) == (T, R, R)  # no join after the window closed


def test_elastic_burst_end_and_between_steps():
    end = snap([T, T, T], steps_in_burst=2, mu=2, ready_groups=3)
    assert elastic_policy(end) == (T, R, R)  # satellites back; the core stays to publish
    dry = snap([T, T, R], steps_in_burst=1, mu=2, ready_groups=0, running=3)
    assert elastic_policy(dry) == (R, R, R)  # between steps without supply: the core returns too
    crowded = snap([T, R, R], steps_in_burst=1, mu=2, ready_groups=2, running=25)
    assert elastic_policy(crowded) == (R, R, R)  # the capacity check failed
    going = snap([T, R, R], steps_in_burst=1, mu=2, ready_groups=2, running=5)
    assert elastic_policy(going) == (T, R, R)


def test_async_and_colocate():
    assert async_policy(snap([R, R, R, R], async_training_cells=2)) == (T, T, R, R)
    assert colocate_policy(snap([R, R], running=1, ready_groups=5)) == (R, R)
    assert colocate_policy(snap([R, R], ready_groups=2)) == (T, T)
    assert colocate_policy(snap([T, T], ready_groups=0, steps_in_burst=0)) == (R, R)
    assert colocate_policy(snap([T, T], step_in_flight=True)) == (T, T)


roles_st = st.lists(st.sampled_from([R, T]), min_size=1, max_size=6).map(
    lambda rs: [T] * rs.count(T) + [R] * rs.count(R))  # training cells form a prefix, as the coordinator keeps them


@settings(max_examples=500, deadline=None)
@given(roles=roles_st, queued=st.integers(0, 40), running=st.integers(0, 60), ready=st.integers(0, 6),
       steps=st.integers(0, 3), mu=st.integers(1, 3), flight=st.booleans(), window=st.booleans(),
       unclaimed=st.integers(0, 4), cap=st.integers(1, 20), standalone=st.integers(0, 10))
def test_elastic_invariants(roles, queued, running, ready, steps, mu, flight, window, unclaimed, cap, standalone):
    flight = flight and roles[0] == T  # a batch in flight always has the core training
    s = Snapshot(roles=tuple(roles), queued=queued, running=running, ready_groups=ready, groups_per_step=2,
                 mu=mu, steps_in_burst=min(steps, mu), step_in_flight=flight, window_open=flight and window,
                 unclaimed=unclaimed if flight else 0, capacity=(cap,) * len(roles), standalone=standalone)
    out = elastic_policy(s)
    assert len(out) == len(roles)
    k = out.count(T)
    assert out == (T,) * k + (R,) * (len(roles) - k)  # a prefix: cell 0 first, satellites in order
    moved = [c for c in range(len(roles)) if roles[c] == R and out[c] == T]
    if moved:  # a cell leaves rollout only when what remains covers the waterlevel
        assert s.rollout_capacity(out) >= s.waterlevel
    if flight:  # cells never leave a batch in flight
        assert all(out[c] == T for c in range(len(roles)) if roles[c] == T)
    if flight and not s.window_open:
        assert not moved  # no join after the window closed


def test_every_policy_is_registered():
    assert set(POLICIES) == {"elastic", "async", "async-streaming", "colocate"}
    assert POLICIES["async"].roles is POLICIES["async-streaming"].roles is async_policy
    assert [p for p in POLICIES if POLICIES[p].full_batch] == ["colocate", "async"]
    assert [p for p in POLICIES if POLICIES[p].fixed_split] == ["async", "async-streaming"]
    assert POLICIES["async"].initial_roles(4, 2) == (T, T, R, R)
    assert POLICIES["elastic"].initial_roles(3, 2) == (R, R, R)
    assert POLICIES["async"].groups_to_start(8) == 8 and POLICIES["async-streaming"].groups_to_start(8) == 1
