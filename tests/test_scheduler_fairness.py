"""Projects in the scheduler: quotas (rule 7) and fair share (rule 8), as
pure functions of the queue, the workers and the projects' shares."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

import scheduler_reference
from gpulayer.scheduler import (
    Assignment,
    Capacity,
    Preemption,
    Quota,
    Request,
    Shares,
    Victim,
    Waiting,
    explain,
    order,
    place,
    preempt,
)
from test_scheduler import cpu, gpu, scenarios

PROJECTS = ("vision", "nlp", "audio")


def placed(got: list[Assignment]) -> list[str]:
    return list(dict.fromkeys(a.job_id for a in got))


def one_gpu_jobs(project: str, n: int, first_seq: int = 0, gpus: int = 1) -> list[Request]:
    return [
        Request(f"{project}{i}", 0, first_seq + i, gpus=gpus, project=project) for i in range(n)
    ]


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_with_one_project_and_no_quota_placement_is_what_it_was(
    scenario: tuple[list[Request], list[Capacity]],
) -> None:
    reqs, caps = scenario
    assert place(reqs, caps) == scheduler_reference.place(order(reqs), caps)


def test_the_project_with_less_recent_usage_goes_first() -> None:
    # nlp submitted first, but vision used less lately: vision's job runs.
    reqs = [*one_gpu_jobs("nlp", 1), *one_gpu_jobs("vision", 1, first_seq=1)]
    shares = Shares(usage={"nlp": 3600.0, "vision": 10.0})
    assert placed(place(reqs, [gpu("w", 1)], shares=shares)) == ["vision0"]
    # No usage on record: first come, first served.
    assert placed(place(reqs, [gpu("w", 1)])) == ["nlp0"]


def test_priority_still_comes_before_fair_share() -> None:
    reqs = [Request("urgent", 5, 2, gpus=1, project="nlp"), *one_gpu_jobs("vision", 1)]
    shares = Shares(usage={"nlp": 1e9})
    assert placed(place(reqs, [gpu("w", 1)], shares=shares)) == ["urgent"]


def test_one_pass_shares_free_gpus_between_equal_projects() -> None:
    # Both idle lately, nlp first in line with 8 jobs: the 4 free GPUs go
    # 2 and 2, not 4 to whoever submitted first.
    reqs = [*one_gpu_jobs("nlp", 8), *one_gpu_jobs("vision", 8, first_seq=8)]
    got = place(reqs, [gpu("w", 4)], shares=Shares())
    assert Counter(r.rstrip("0123456789") for r in placed(got)) == {"nlp": 2, "vision": 2}


def test_a_project_at_its_quota_waits_and_others_go_past_it() -> None:
    reqs = [*one_gpu_jobs("vision", 4), *one_gpu_jobs("nlp", 2, first_seq=4)]
    shares = Shares(quotas={"vision": Quota(gpus=2)}, held={"vision": (1, 0)})
    got = placed(place(reqs, [gpu("w", 8)], shares=shares))
    assert sorted(got) == ["nlp0", "nlp1", "vision0"]  # vision: 1 held + 1 = its quota of 2
    waiting = Request("vision1", 0, 1, gpus=1, project="vision")
    held = Shares(quotas={"vision": Quota(gpus=2)}, held={"vision": (2, 0)})
    assert explain(waiting, [gpu("w", 8)], shares=held) == (
        "project vision is at its quota of 2 GPUs (2 in use, this job needs 1)"
    )


def test_cpu_slots_have_a_quota_of_their_own() -> None:
    reqs = [Request(f"c{i}", 0, i, project="etl") for i in range(5)]
    shares = Shares(quotas={"etl": Quota(slots=3)})
    assert len(place(reqs, [cpu("w", 8)], shares=shares)) == 3
    # A GPU quota does not limit CPU jobs, nor a slot quota GPU jobs.
    assert len(place(reqs, [cpu("w", 8)], shares=Shares(quotas={"etl": Quota(gpus=0)}))) == 5


def test_a_gang_counts_every_node_against_the_quota() -> None:
    gang = Request("g", 0, 0, gpus=2, nodes=2, project="vision")  # 4 GPUs in all
    caps = [gpu("a", 2), gpu("b", 2)]
    assert place([gang], caps, shares=Shares(quotas={"vision": Quota(gpus=3)})) == []
    assert len(place([gang], caps, shares=Shares(quotas={"vision": Quota(gpus=4)}))) == 2


def test_a_job_bigger_than_the_whole_quota_blocks_nothing_and_says_so() -> None:
    big = Request("big", 0, 0, gpus=8, project="vision")
    small = one_gpu_jobs("vision", 2, first_seq=1)
    shares = Shares(quotas={"vision": Quota(gpus=4)})
    assert placed(place([big, *small], [gpu("w", 8)], shares=shares)) == ["vision0", "vision1"]
    assert explain(big, [gpu("w", 8)], shares=shares) == (
        "needs 8 GPUs, more than project vision's quota of 4 GPUs: "
        "it cannot run unless an admin raises the quota"
    )


def test_within_a_project_a_big_job_is_not_overtaken_by_its_later_small_ones() -> None:
    # Quota 4, 3 held: the 4-GPU job waits, and the project's later GPU
    # jobs, of any size, wait behind it (else a stream of 1-GPU jobs would
    # keep it waiting for ever); its CPU jobs, on another quota, do not.
    reqs = [
        Request("big", 0, 0, gpus=4, project="vision"),
        Request("big2", 0, 1, gpus=4, project="vision"),
        Request("one", 0, 2, gpus=1, project="vision"),
        Request("cpu", 0, 3, gpus=0, project="vision"),
        Request("other", 0, 4, gpus=1, project="nlp"),
    ]
    shares = Shares(quotas={"vision": Quota(gpus=4, slots=2)}, held={"vision": (3, 0)})
    caps = [gpu("w", 8, {3, 4, 5, 6, 7}), cpu("c", 2)]
    assert sorted(placed(place(reqs, caps, shares=shares))) == ["cpu", "other"]
    # A higher-priority job of the project is not held behind a lower one.
    urgent = Request("urgent", 5, 5, gpus=1, project="vision")
    assert "urgent" in placed(place([*reqs, urgent], caps, shares=shares))


def test_a_job_that_can_never_fit_does_not_switch_preemption_off_for_the_rest() -> None:
    # From the review: a careless user's high-priority 16-GPU job, where the
    # largest worker has 8, came first; the 1-GPU job behind it still gets
    # room by preemption.
    full = [gpu("w", 8, set())]
    running = [victim("low", 0, 1.0, "w", *range(8))]
    waiting = [Request("huge", 10, 1, gpus=16), Request("small", 5, 2, gpus=1)]
    got = preempt(waiting, full, running, now=100.0)
    assert got is not None and got.for_job == "small"


def test_a_quota_lowered_under_what_runs_places_nothing_more_and_kills_nothing() -> None:
    reqs = one_gpu_jobs("vision", 3)
    shares = Shares(quotas={"vision": Quota(gpus=1)}, held={"vision": (4, 0)})
    assert place(reqs, [gpu("w", 8)], shares=shares) == []  # (placement never stops a job)


def test_the_queue_keeps_rank_order_across_shapes_and_projects() -> None:
    rng = random.Random(7)
    reqs = [
        Request(
            f"j{i}", rng.randint(-1, 1), i, gpus=rng.randint(0, 2), project=rng.choice(PROJECTS)
        )
        for i in range(200)
    ]
    waiting = Waiting(reqs)
    for r in reqs[::3]:
        assert waiting.remove(r.job_id) == r
    left = [r for i, r in enumerate(reqs) if i % 3]
    assert list(waiting) == order(left)
    assert len(waiting) == len(left) and reqs[1].job_id in waiting
    assert reqs[0].job_id not in waiting
    assert waiting.top_priority() == max(r.priority for r in left)
    assert Waiting().top_priority() is None


@st.composite
def shared_scenarios(
    draw: st.DrawFn,
) -> tuple[list[Request], list[Capacity], Shares]:
    reqs, caps = draw(scenarios())
    projects = draw(st.lists(st.sampled_from(PROJECTS), min_size=len(reqs), max_size=len(reqs)))
    reqs = [
        Request(r.job_id, r.priority, r.seq, r.gpus, r.nodes, project=p)
        for r, p in zip(reqs, projects, strict=True)
    ]
    quota = st.one_of(st.none(), st.integers(0, 8))
    quotas = {p: Quota(draw(quota), draw(quota)) for p in PROJECTS if draw(st.booleans())}
    held = {p: (draw(st.integers(0, 6)), draw(st.integers(0, 6))) for p in PROJECTS}
    usage = {p: draw(st.floats(0, 1e6)) for p in PROJECTS}
    return reqs, caps, Shares(quotas, held, usage)


@settings(max_examples=400, deadline=None)
@given(shared_scenarios())
def test_placement_never_takes_a_project_past_its_quota_nor_overcommits_a_slot(
    scenario: tuple[list[Request], list[Capacity], Shares],
) -> None:
    reqs, caps, shares = scenario
    got = place(reqs, caps, shares=shares)
    assert all(n == 1 for n in Counter((a.worker_id, s) for a in got for s in a.slots).values())
    by_worker = {c.worker_id: c for c in caps}
    assert all(set(a.slots) <= by_worker[a.worker_id].free for a in got)
    by_job = {r.job_id: r for r in reqs}
    for project, quota in shares.quotas.items():
        mine = [by_job[j] for j in placed(got) if by_job[j].project == project]
        if not mine:
            continue
        gpus, slots = shares.held[project]
        gpus += sum(r.demand[0] for r in mine)
        slots += sum(r.demand[1] for r in mine)
        assert quota.gpus is None or gpus <= max(quota.gpus, shares.held[project][0])
        assert quota.slots is None or slots <= max(quota.slots, shares.held[project][1])
        # Anything placed for it fitted under the quota as it was placed.
        if quota.gpus is not None and any(r.gpus for r in mine):
            assert gpus <= quota.gpus
        if quota.slots is not None and any(not r.gpus for r in mine):
            assert slots <= quota.slots


def _simulate(
    reqs: list[Request], caps: list[Capacity], quotas: dict[str, Quota], seed: int
) -> tuple[set[str], set[str]]:
    """Run the queue to its end: each step places what it can, then one
    random running job ends. Returns (placed, never placed)."""
    rng = random.Random(seed)
    waiting = Waiting(reqs)
    free = {c.worker_id: set(c.free) for c in caps}
    shape = {c.worker_id: c.slot_gpus for c in caps}
    running: dict[str, list[Assignment]] = {}
    held: dict[str, tuple[int, int]] = {}
    usage: Counter[str] = Counter()
    done: set[str] = set()
    for _ in range(20 * len(reqs) + 10):
        now_caps = [Capacity(w, shape[w], frozenset(free[w])) for w in free]
        got = place(waiting, now_caps, shares=Shares(quotas, dict(held), dict(usage)))
        for job_id in placed(got):
            req = waiting.remove(job_id)
            running[job_id] = [a for a in got if a.job_id == job_id]
            for a in running[job_id]:
                free[a.worker_id] -= set(a.slots)
            g, s = held.get(req.project, (0, 0))
            held[req.project] = (g + req.demand[0], s + req.demand[1])
            usage[req.project] += req.demand[0] + 0.1 * req.demand[1]
            done.add(job_id)
        if not running:
            break
        ended = rng.choice(sorted(running))
        req = next(r for r in reqs if r.job_id == ended)
        for a in running.pop(ended):
            free[a.worker_id] |= set(a.slots)
        g, s = held[req.project]
        held[req.project] = (g - req.demand[0], s - req.demand[1])
    return done, {r.job_id for r in reqs} - done


@settings(max_examples=150, deadline=None)
@given(shared_scenarios(), st.integers(0, 2**32))
def test_no_job_waits_forever_while_capacity_for_it_keeps_freeing(
    scenario: tuple[list[Request], list[Capacity], Shares], seed: int
) -> None:
    reqs, caps, shares = scenario
    # Every slot free at the start, and projects hold nothing yet.
    caps = [Capacity(c.worker_id, c.slot_gpus, frozenset(range(len(c.slot_gpus)))) for c in caps]
    quotas = dict(shares.quotas)
    _, never = _simulate(reqs, caps, quotas, seed)
    by_job = {r.job_id: r for r in reqs}
    for job_id in never:
        req = by_job[job_id]
        able = [
            c
            for c in caps
            if (sum(g is not None for g in c.slot_gpus) >= req.gpus if req.gpus else c.slot_gpus)
        ]
        too_big = quotas.get(req.project, Quota()).exceeded_by(req.demand)
        assert len(able) < req.nodes or too_big is not None, (
            f"{req} never ran, though {len(able)} workers could hold it and its quota allows it"
        )


# ---- preemption (rule 9) ----


def victim(job_id: str, priority: int, started: float, worker: str, *slots: int) -> Victim:
    return Victim(job_id, priority, started, {worker: slots})


def test_preemption_stops_the_fewest_lowest_most_recent_jobs_for_a_higher_priority_one() -> None:
    full = [gpu("a", 4, set()), gpu("b", 4, set())]
    running = [
        victim("old-low", 0, 100.0, "a", 0, 1),
        victim("new-low", 0, 200.0, "a", 2, 3),
        victim("mid", 1, 300.0, "b", 0, 1, 2, 3),
    ]
    urgent = Request("urgent", 5, 9, gpus=2)
    got = preempt([urgent], full, running)
    assert got == Preemption("urgent", ("new-low",), ("a",))  # one job is enough: the newest
    big = Request("big", 5, 9, gpus=4)
    # Two jobs on a, or one on b: the fewest wins, though it is of higher priority.
    assert preempt([big], full, running) == Preemption("big", ("mid",), ("b",))


def test_nothing_is_preempted_for_a_job_of_equal_or_lower_priority() -> None:
    full = [gpu("a", 2, set())]
    running = [victim("v", 3, 1.0, "a", 0, 1)]
    assert preempt([Request("same", 3, 1, gpus=1)], full, running) is None
    assert preempt([Request("lower", 1, 1, gpus=1)], full, running) is None


def test_nothing_is_preempted_for_a_job_that_waits_for_its_quota_or_its_back_off() -> None:
    full = [gpu("a", 2, set())]
    running = [victim("v", 0, 1.0, "a", 0, 1)]
    at_quota = Shares(quotas={"vision": Quota(gpus=1)}, held={"vision": (1, 0)})
    req = Request("r", 5, 1, gpus=1, project="vision")
    assert preempt([req], full, running, shares=at_quota) is None
    backing_off = Request("r", 5, 1, gpus=1, not_before=50.0)
    assert preempt([backing_off], full, running, now=10.0) is None


def test_a_gang_preempts_on_as_many_workers_as_it_has_nodes() -> None:
    full = [gpu("a", 2, set()), gpu("b", 2, set()), gpu("c", 2, {0, 1})]
    running = [victim("va", 0, 1.0, "a", 0, 1), victim("vb", 0, 2.0, "b", 0, 1)]
    gang = Request("g", 5, 1, gpus=2, nodes=2)
    got = preempt([gang], full, running)
    # c is free already; one of a and b gives way: the most recent, vb.
    assert got.victims == ("vb",) and set(got.workers) == {"b", "c"}


def test_workers_held_for_a_job_take_no_other() -> None:
    caps = [gpu("a", 2)]
    reqs = [Request("other", 9, 0, gpus=1), Request("mine", 5, 1, gpus=2)]
    got = place(reqs, caps, held_for={"a": "mine"})
    assert placed(got) == ["mine"]


@settings(max_examples=300, deadline=None)
@given(shared_scenarios(), st.data())
def test_preemption_only_stops_lower_priority_preemptible_jobs_and_makes_enough_room(
    scenario: tuple[list[Request], list[Capacity], Shares], data: st.DataObject
) -> None:
    reqs, caps, shares = scenario
    running: list[Victim] = []
    for cap in caps:
        busy = sorted(set(range(len(cap.slot_gpus))) - cap.free)
        while busy:
            n = data.draw(st.integers(1, len(busy)))
            taken, busy = busy[:n], busy[n:]
            running.append(
                victim(
                    f"v{len(running)}",
                    data.draw(st.integers(-2, 2)),
                    float(len(running)),
                    cap.worker_id,
                    *taken,
                )
            )
    got = preempt(reqs, caps, running, shares=shares)
    if got is None:
        return
    by_job = {r.job_id: r for r in reqs}
    req = by_job[got.for_job]
    stopped = [v for v in running if v.job_id in got.victims]
    assert stopped and all(v.priority < req.priority for v in stopped)
    assert len(got.workers) == req.nodes == len(set(got.workers))
    for worker_id in got.workers:
        cap = next(c for c in caps if c.worker_id == worker_id)
        freed = set(cap.free) | {s for v in stopped for s in v.slots.get(worker_id, ())}
        if req.gpus:
            assert sum(cap.slot_gpus[s] is not None for s in freed) >= req.gpus
        else:
            assert freed
