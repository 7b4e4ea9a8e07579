"""Worker of tests/train/test_multiprocess.py's remote-rollout test: the trainer alone in its
processes, its rollouts on `nonstop serve` servers in other processes.

    NONSTOP_TEST_SERVERS=URL,URL ROLLOUT_KEY=KEY \\
    python -m tests.train.multiprocess_remote_worker OUT --devices 2 --process-id I \\
        --num-processes 2 --port PORT

Runs `multiprocess_worker.run_agentic_recipe` (same config, same stop after step 1 and resume)
with `rollout.backend: remote` over the servers named, which every process shares.
"""

from __future__ import annotations

import os

from tests.train.multiprocess_worker import run_agentic_recipe, start_worker


def main() -> None:
    from nonstop.agentic.config import RolloutConfig
    from nonstop.train import distributed

    out = start_worker()
    servers = tuple(os.environ["NONSTOP_TEST_SERVERS"].split(","))
    run_agentic_recipe(out, RolloutConfig(backend="remote", servers=servers,
                                          api_key_env="ROLLOUT_KEY"))
    distributed.barrier("worker done")


if __name__ == "__main__":
    main()
