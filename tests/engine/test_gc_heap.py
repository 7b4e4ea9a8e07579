"""`gc_heap_frozen`: objects alive at entry are out of the collector's sight inside, handed back
on exit (so a cycle that died meanwhile is still collected), and an enclosing freeze is left
alone."""

from __future__ import annotations

import gc
import weakref

from nonstop.engine import gc_heap_frozen


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector can free it


def test_the_heap_is_frozen_inside_and_handed_back_on_exit():
    assert gc.get_freeze_count() == 0
    node = Node()
    alive = weakref.ref(node)
    with gc_heap_frozen() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > 0
        assert not any(o is node for o in gc.get_objects())  # not traversed any more
        del node
        gc.collect()
        assert alive() is not None  # frozen: a full collection does not see the dead cycle
        with gc_heap_frozen():  # nested: leaves the outer freeze in place
            pass
        assert gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None  # handed back on exit, so it was collected: nothing leaks
