from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gpulayer.scheduler import Assignment, Capacity, Request, explain, order
from gpulayer.scheduler import place as place_ordered


def place(reqs: list[Request], caps: list[Capacity]) -> list[Assignment]:
    return place_ordered(order(reqs), caps)


def cpu(worker: str, slots: int, free: set[int] | None = None) -> Capacity:
    return Capacity(worker, (None,) * slots, frozenset(range(slots) if free is None else free))


def gpu(worker: str, gpus: int, free: set[int] | None = None) -> Capacity:
    return Capacity(worker, tuple(range(gpus)), frozenset(range(gpus) if free is None else free))


def test_priority_first_then_fifo() -> None:
    reqs = [Request("low", 0, 1), Request("high", 5, 2), Request("low2", 0, 3)]
    got = place(reqs, [cpu("w", 2)])
    assert [a.job_id for a in got] == ["high", "low"]


def test_gpu_job_gets_gpu_slots_and_sees_only_them() -> None:
    got = place([Request("j", 0, 1, gpus=2)], [gpu("w", 4, {1, 2, 3})])
    assert got == [Assignment("j", "w", (1, 2), (1, 2))]


def test_cpu_job_on_gpu_worker_takes_a_slot_but_no_gpu() -> None:
    (a,) = place([Request("j", 0, 1, gpus=0)], [gpu("w", 2)])
    assert len(a.slots) == 1 and a.gpus == ()


def test_job_larger_than_any_worker_waits_and_blocks_nobody() -> None:
    reqs = [Request("huge", 9, 1, gpus=8), Request("small", 0, 2, gpus=1)]
    got = place(reqs, [gpu("a", 4), gpu("b", 2)])
    assert [a.job_id for a in got] == ["small"]
    assert "no worker has that many" in explain(reqs[0], [gpu("a", 4), gpu("b", 2)])


def test_large_job_is_not_starved_by_small_ones() -> None:
    # 'big' needs all 4 GPUs of w; 2 are busy. Later small jobs must not take
    # the 2 free ones, or 'big' could wait forever.
    caps = [gpu("w", 4, {2, 3})]
    reqs = [Request("big", 0, 1, gpus=4)] + [Request(f"s{i}", 0, 2 + i, gpus=1) for i in range(5)]
    assert place(reqs, caps) == []
    # Small jobs still run on a worker the big one could not use anyway.
    assert [a.job_id for a in place(reqs, [*caps, gpu("v", 2)])] == ["s0", "s1"]


def test_best_fit_keeps_room_for_big_jobs() -> None:
    got = place([Request("one", 0, 1, gpus=1)], [gpu("roomy", 4), gpu("tight", 4, {3})])
    assert got[0].worker_id == "tight"


def test_gang_is_all_or_nothing() -> None:
    assert place([Request("g", 0, 1, nodes=3)], [cpu("a", 1), cpu("b", 1)]) == []
    got = place([Request("g", 0, 1, nodes=2)], [cpu("a", 1), cpu("b", 1), cpu("c", 1, set())])
    assert sorted(a.worker_id for a in got) == ["a", "b"]


def test_explain_says_why() -> None:
    assert explain(Request("j", 0, 1), []) == "no workers are connected"
    assert "to be free on a worker" in explain(Request("j", 0, 1, gpus=1), [gpu("w", 2, set())])


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Request], list[Capacity]]:
    caps = []
    for i in range(draw(st.integers(0, 5))):
        n = draw(st.integers(1, 4))
        is_gpu = draw(st.booleans())
        free = draw(st.sets(st.integers(0, n - 1)))
        caps.append(Capacity(f"w{i}", tuple(range(n)) if is_gpu else (None,) * n, frozenset(free)))
    reqs = [
        Request(
            f"j{i}",
            draw(st.integers(-2, 2)),
            i,
            gpus=draw(st.integers(0, 5)),
            nodes=draw(st.integers(1, 3)),
        )
        for i in range(draw(st.integers(0, 12)))
    ]
    return reqs, caps


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_placement_never_overcommits_and_only_places_what_fits(
    scenario: tuple[list[Request], list[Capacity]],
) -> None:
    reqs, caps = scenario
    by_worker = {c.worker_id: c for c in caps}
    by_job = {r.job_id: r for r in reqs}
    got = place(reqs, caps)
    used = Counter((a.worker_id, s) for a in got for s in a.slots)
    assert all(n == 1 for n in used.values()), "a slot was given twice"
    per_job = Counter(a.job_id for a in got)
    for a in got:
        cap, req = by_worker[a.worker_id], by_job[a.job_id]
        assert set(a.slots) <= cap.free, "placed on a busy slot"
        if req.gpus:
            assert len(a.slots) == req.gpus == len(a.gpus)
            assert all(cap.slot_gpus[s] is not None for s in a.slots)
            assert set(a.gpus) == {cap.slot_gpus[s] for s in a.slots}
        else:
            assert len(a.slots) == 1 and a.gpus == ()
    for job_id, n in per_job.items():
        assert n == by_job[job_id].nodes, "a gang was placed partly"
        assert len({a.worker_id for a in got if a.job_id == job_id}) == n, "a gang shares a worker"


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_a_lower_ranked_job_never_overtakes_on_its_reserved_worker(
    scenario: tuple[list[Request], list[Capacity]],
) -> None:
    # Order: if every job fits alone, the highest-ranked one is always placed.
    reqs, caps = scenario
    got = place(reqs, caps)
    if got and reqs:
        first = min(reqs, key=lambda r: (-r.priority, r.seq))
        fits_now = sum(
            1
            for c in caps
            if (
                len([s for s in c.free if c.slot_gpus[s] is not None]) >= first.gpus
                if first.gpus
                else c.free
            )
        )
        if fits_now >= first.nodes:
            assert first.job_id in {a.job_id for a in got}
