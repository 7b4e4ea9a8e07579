"""`keep_freed_host_memory`: after it, glibc serves a large buffer from its heap (no new mapping)
and keeps it when freed (no trim), so the next buffer of that size reuses mapped pages. Each
case runs in a fresh interpreter: the setting is process-wide and cannot be undone."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# Counts glibc's memory in mmapped chunks (hblkhd) and in the heap (arena) around a 64 MiB
# buffer's life, before and after the call (mallinfo2, glibc >= 2.33).
PROBE = """
import ctypes, json
import numpy as np
from nonstop.engine.host_memory import keep_freed_host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
MiB = 1 << 20

def life_of_a_buffer():
    before = libc.mallinfo2()
    buffer = np.ones(64 * MiB, np.uint8)
    held = libc.mallinfo2()
    del buffer
    after = libc.mallinfo2()
    # (MiB newly mapped for it, MiB the heap grew by, bytes the heap shrank by when freed)
    return ((held.hblkhd - before.hblkhd) // MiB, (held.arena - before.arena) // MiB,
            held.arena - after.arena)

default = life_of_a_buffer()
applied = keep_freed_host_memory()
kept = life_of_a_buffer()
again = life_of_a_buffer()
print(json.dumps([default, applied, keep_freed_host_memory(), kept, again]))
"""


def test_large_buffers_come_from_the_heap_and_stay_there():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout
    default, applied, applied_again, kept, again = json.loads(out)
    # glibc's default: 64 MiB is its own mapping, outside the heap, unmapped when freed.
    assert default[0] == 64
    assert applied is applied_again is True  # took effect; a second call is a no-op
    # After: the buffer comes from the heap, and freeing it gives nothing back ...
    assert kept[0] == 0 and 0 < kept[1] <= 64 and kept[2] == 0
    # ... so the next buffer of that size reuses those pages: neither mapping nor growth.
    assert again == [0, 0, 0]


ENGINE = """
import json, sys
from nonstop.engine import Engine, EngineConfig, host_memory
from nonstop.models import ModelConfig, init_decoder

Engine(init_decoder(ModelConfig.tiny("qwen3"), seed=0),
       EngineConfig(max_slots=2, max_len=32, keep_host_memory=sys.argv[1] == "on"))
print(json.dumps(host_memory._applied))
"""


@pytest.mark.parametrize(("setting", "applied"), [("on", True), ("off", None)])
def test_the_engine_applies_it_on_cpu_only_when_its_config_says_so(setting, applied):
    out = subprocess.run([sys.executable, "-c", ENGINE, setting], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out) is applied
