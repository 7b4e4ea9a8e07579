"""`gc_heap_frozen`: objects alive at entry are out of the collector's sight inside, handed back
on exit (so a cycle that died meanwhile is still collected), and an enclosing freeze is left
alone; the young generation's threshold is raised inside and restored on exit."""

from __future__ import annotations

import gc
import weakref

import pytest

from nonstop.engine import gc_heap_frozen


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector can free it


def test_the_heap_is_frozen_inside_and_handed_back_on_exit():
    assert gc.get_freeze_count() == 0
    thresholds = gc.get_threshold()
    node = Node()
    alive = weakref.ref(node)
    with gc_heap_frozen() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > 0
        assert gc.get_threshold() == (max(20_000, thresholds[0]), *thresholds[1:])
        assert not any(o is node for o in gc.get_objects())  # not traversed any more
        del node
        gc.collect()
        assert alive() is not None  # frozen: a full collection does not see the dead cycle
        with gc_heap_frozen(young_threshold=5):  # nested: leaves the outer's settings
            assert gc.get_threshold()[0] == max(20_000, thresholds[0])
        assert gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    gc.collect()
    assert alive() is None  # handed back on exit, so it was collected: nothing leaks


def test_a_bad_threshold_is_refused_before_anything_changes():
    thresholds = gc.get_threshold()
    with pytest.raises(ValueError, match="young_threshold"), gc_heap_frozen(young_threshold=0):
        pass
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
