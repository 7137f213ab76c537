from __future__ import annotations

import threading

from gpulayer.ids import new_id


def test_ids_are_unique_and_ordered_even_in_a_burst() -> None:
    ids = [new_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert all(len(i) == 14 and i.isalnum() and i.islower() for i in ids[:100])


def test_ids_from_many_threads_never_collide() -> None:
    found: list[str] = []

    def make() -> None:
        found.extend(new_id() for _ in range(2_000))

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(found)) == 8_000
