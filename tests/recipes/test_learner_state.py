"""The group cursor a checkpoint holds, read back by a run with one process or several."""

from __future__ import annotations

import itertools

from nonstop.agentic.streaming import GroupCursor
from nonstop.recipes.learner_state import process_cursor, resumed_group_ids


def test_a_fresh_run_draws_from_zero_and_a_resumed_one_regenerates_its_pending_groups_first():
    assert list(itertools.islice(resumed_group_ids(GroupCursor(), 4), 6)) == [0, 1, 2, 3, 4, 5]
    resumed = resumed_group_ids(GroupCursor(pending=(5, 7), next=9), 4)
    assert list(itertools.islice(resumed, 5)) == [5, 7, 9, 10, 11]


def test_pending_ids_of_a_run_with_more_processes_are_all_taken_by_one():
    # A two-process run's checkpoint read by one process: every process's pending ids are its.
    assert process_cursor([[2, 3], [6]], [4, 8]) == GroupCursor(pending=(2, 3, 6), next=8)
    assert process_cursor([[4]], [6]) == GroupCursor(pending=(4,), next=6)


def test_each_of_two_processes_resumes_its_own_share_of_the_step_blocks(monkeypatch):
    # Two processes, 4 groups a step: process 0 owns ids 0-1, 4-5, 8-9, ..., process 1 2-3,
    # 6-7, ... Stopped after step 1 with each one's first id of step 2 drawn (in flight).
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    expected = {0: [4, 5, 8, 9, 12], 1: [6, 7, 10, 11, 14]}
    for rank, cursor in ((0, GroupCursor(pending=(4,), next=5)),
                         (1, GroupCursor(pending=(6,), next=7))):
        monkeypatch.setattr(jax, "process_index", lambda rank=rank: rank)
        assert list(itertools.islice(resumed_group_ids(cursor, 4), 5)) == expected[rank]
        assert process_cursor([[4], [6]], [5, 7]) == cursor
