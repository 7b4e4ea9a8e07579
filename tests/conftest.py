"""Suite-wide setup: eight forced CPU devices for sharding tests, float32 everywhere, and one
persistent XLA compilation cache for the run.

The cache starts empty in a directory of its own (the environment passes it to the subprocesses
the tests start: CLI runs, resumed runs, servers, the jax.distributed workers), so a program
compiled once is loaded, not compiled again, by the next process or test that builds it.
Compiles of 0.1 s and more are kept (keeping every one, the many tiny ones included, made the
whole suite slower: 2,083 s against 1,773 s), and the subprocesses get a fixed PYTHONHASHSEED: with hash
randomization some set or dict order reaches a trace, the HLO differs between processes and
every process misses the cache. Tests that assert nothing compiles after warm-up count cache
loads as compiles too (`tests.engine.engine_fixtures.record_compiles`).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="nonstop-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("PYTHONHASHSEED", "0")  # read by the subprocesses only
