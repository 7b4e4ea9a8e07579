"""Two processes under `jax.distributed` (localhost, gloo CPU collectives, 2 devices each) equal one
process on 4 devices for what reads the whole step: PPO (critic, GAE whitened over every
process's tokens, KL as a per-token reward penalty), RLOO's episode-level KL penalty
(`sequence_kl`, with uneven per-process batch counts) and DPO with a precomputed reference (the
collective reference pass, its cache written once).

The worker is `tests/train/multiprocess_ppo_dpo_worker.py`; launching and waiting (every wait has
a timeout, so a hung collective fails instead of hanging CI) are `test_multiprocess.py`'s.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from tests.train.multiprocess_ppo_dpo_worker import PPO_STATS, PPO_STEPS
from tests.train.test_multiprocess import TOLERANCE, load, max_abs_diff, run_single_and_multi


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, str]:
    return run_single_and_multi("tests.train.multiprocess_ppo_dpo_worker",
                                tmp_path_factory.mktemp("multiprocess_ppo_dpo"))


def test_ppo_two_processes_equal_one(runs):
    single, multi = runs
    for name in ("ppo", "critic"):
        initial = load(f"{single}/{name}_initial.npz")
        final = load(f"{single}/{name}_params.npz")
        assert max_abs_diff(initial, final) > 1e-3, name  # the steps moved the weights
        assert max_abs_diff(final, load(f"{multi}/{name}_params.npz")) <= TOLERANCE, name
    stats = []
    for out in runs:
        with open(os.path.join(out, "ppo.json")) as f:
            stats.append(np.asarray([[step[k] for k in PPO_STATS] for step in json.load(f)]))
    assert stats[0].shape == (PPO_STEPS, len(PPO_STATS))
    # Whitening stats and the reward KL are over both processes' tokens, not one's own half.
    np.testing.assert_allclose(stats[1], stats[0], rtol=0, atol=TOLERANCE)
    kl = stats[0][:, PPO_STATS.index("reward_kl")]
    assert np.all(kl > 0.1), kl
    assert np.all(stats[0][:, PPO_STATS.index("advantage_std_raw")] > 0.1)


def test_sequence_kl_two_processes_equal_one(runs):
    single, multi = runs
    one = np.load(f"{single}/sequence_kl_0.npy")
    # Process 0 held shards 0, 2, 3 (12 episodes, 3 batches), process 1 shard 1 (4 episodes,
    # 1 batch and 2 empty reference passes); one process held all 16 in that order.
    two = [np.load(f"{multi}/sequence_kl_{i}.npy") for i in range(2)]
    assert [len(x) for x in two] == [12, 4] and one.shape == (16,)
    assert np.all(np.abs(one) > 1e-2), one
    np.testing.assert_allclose(np.concatenate(two), one, rtol=0, atol=TOLERANCE)


def test_precomputed_dpo_two_processes_equal_one(runs):
    single, multi = runs
    for out in runs:
        with open(os.path.join(out, "dpo.json")) as f:
            assert json.load(f)["last_step"] == 3
        # Written once, by process 0, into the run directory; nothing beside it.
        found = glob.glob(os.path.join(out, "dpo", "**", "reference_logprobs*"), recursive=True)
        assert found == [os.path.join(out, "dpo", "reference_logprobs.npz")], found
    caches = [load(os.path.join(out, "dpo", "reference_logprobs.npz")) for out in runs]
    assert caches[0]["logprobs"].size > 100
    # Origins are "path:line" of each run's own data file.
    lines = [[str(o).rsplit("/", 1)[1] for o in cache["origins"]] for cache in caches]
    assert lines[0] == lines[1] and len(lines[0]) == 20
    np.testing.assert_allclose(caches[1]["logprobs"], caches[0]["logprobs"], rtol=0,
                               atol=TOLERANCE)
    final = load(f"{single}/dpo_params.npz")
    assert max_abs_diff(final, load(f"{multi}/dpo_params.npz")) <= TOLERANCE
    curves = []
    for out in runs:
        lines = [json.loads(x) for x in open(os.path.join(out, "dpo", "metrics.jsonl"))]
        curves.append([x["loss"] for x in lines if "loss" in x])
    np.testing.assert_allclose(curves[1], curves[0], rtol=0, atol=TOLERANCE)
    # The policy starts as the reference (loss ln 2), and the steps moved it.
    assert len(curves[0]) == 3 and curves[0][0] == pytest.approx(np.log(2), abs=1e-5)
    assert curves[0][-1] < curves[0][0] - 0.01, curves[0]
