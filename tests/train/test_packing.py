"""Packing invariants: whole examples, correct segments and positions, static shapes, stats."""

import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.models.validation import ConfigError
from nonstop.sft.losses import preference_pairs, sequence_logprobs
from nonstop.train.batch import TrainBatch, target_mask
from nonstop.train.packing import (
    BatchPacker,
    PackingConfig,
    PackingStats,
    TokenSequence,
    pack_least_padding,
    pack_units,
)


def _seq(length: int, start: int = 1, origin: str = "test", **extra) -> TokenSequence:
    return TokenSequence(
        tokens=np.arange(start, start + length),
        loss_mask=np.ones(length, bool),
        origin=origin,
        **extra,
    )


def test_first_fit_layout_and_stats():
    config = PackingConfig(buckets=(8, 16), rows_per_batch=3)
    units = [(_seq(n, start=10 * i),) for i, n in enumerate([5, 3, 7, 2, 6])]
    (packed,) = list(pack_units(units, config))
    # First fit into rows of 16: 5 -> row 0 (5), 3 -> row 0 (8), 7 -> row 0 (15),
    # 2 -> row 1 (row 0 would hold 17), 6 -> row 1 (8). Longest row 15 -> bucket 16.
    batch = packed.batch
    assert batch.shape == (3, 16)
    expected_row0 = [1] * 5 + [2] * 3 + [3] * 7 + [0]
    assert batch.segment_ids[0].tolist() == expected_row0
    assert batch.segment_ids[1].tolist() == [1] * 2 + [2] * 6 + [0] * 8
    assert batch.segment_ids[2].tolist() == [0] * 16  # a whole padding row keeps B static
    assert batch.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0]
    assert batch.tokens[0, 5:8].tolist() == [10, 11, 12]  # the second unit, intact
    # The first token of each sequence is never a target; padding never is.
    assert not batch.loss_mask[0, [0, 5, 8, 15]].any()
    assert batch.loss_mask[0, [1, 4, 6, 9, 14]].all()
    # real = 5 + 3 + 7 + 2 + 6 = 23 of 3 * 16 = 48.
    assert packed.stats == PackingStats(
        units=5, sequences=5, rows_used=2, real_tokens=23, padded_tokens=25
    )
    assert packed.stats.fill_ratio == pytest.approx(23 / 48)
    # Placements, in the order the units were added: (row, segment, start, length).
    assert [(p.row, p.segment, p.start, p.length) for p in packed.placements] == [
        (0, 1, 0, 5), (0, 2, 5, 3), (0, 3, 8, 7), (1, 1, 0, 2), (1, 2, 2, 6)
    ]
    assert [s.tolist() for s in packed.gather(batch.tokens)] == [
        list(range(10 * i, 10 * i + n)) for i, n in enumerate([5, 3, 7, 2, 6])
    ]


def test_batch_emitted_when_full_and_smallest_bucket_chosen():
    config = PackingConfig(buckets=(8, 16), rows_per_batch=1)
    batches = list(pack_units([(_seq(10),), (_seq(9),), (_seq(3),), (_seq(4),)], config))
    # 10 opens row 0; 9 does not fit (19 > 16) -> batch 1 = [10]; then 9 + 3 + 4 = 16 fit.
    assert [b.batch.shape for b in batches] == [(1, 16), (1, 16)]
    assert [b.stats.units for b in batches] == [1, 3]
    small = list(pack_units([(_seq(3),), (_seq(4),)], config))
    assert small[0].batch.shape == (1, 8)


def test_segment_limit_starts_new_row():
    config = PackingConfig(buckets=(32,), rows_per_batch=2, max_segments_per_row=2)
    (packed,) = list(pack_units([(_seq(2),)] * 3, config))
    assert packed.batch.segment_ids[:, :4].tolist() == [[1, 1, 2, 2], [1, 1, 0, 0]]


def test_random_stream_never_splits_examples():
    rng = np.random.default_rng(7)
    config = PackingConfig(buckets=(13, 29, 61), rows_per_batch=5)
    lengths = rng.integers(1, 40, size=211)
    units = [(_seq(int(n), start=int(1000 * i)),) for i, n in enumerate(lengths)]
    recovered, total = [], PackingStats()
    for packed in pack_units(units, config):
        batch = packed.batch
        assert batch.shape[0] == 5 and batch.shape[1] in config.buckets
        total = total + packed.stats
        for row in range(5):
            for segment in range(1, batch.segment_ids[row].max() + 1):
                where = batch.segment_ids[row] == segment
                assert np.all(np.diff(np.flatnonzero(where)) == 1)  # contiguous
                assert batch.positions[row, where].tolist() == list(range(where.sum()))
                recovered.append(batch.tokens[row, where].tolist())
    # Every example appears exactly once and whole, in stream order within the stream.
    assert sorted(recovered) == sorted(u[0].tokens.tolist() for u in units)
    assert total.real_tokens == lengths.sum() and total.units == 211
    assert total.fill_ratio > 0.8


def test_pad_mode_one_example_per_row():
    config = PackingConfig(buckets=(4, 8, 16), rows_per_batch=2, mode="pad")
    batches = list(pack_units([(_seq(3),), (_seq(6),), (_seq(2),)], config))
    # Rows (3, 6) -> bucket 8; then (2) alone -> bucket 4 with one padding row.
    assert [b.batch.shape for b in batches] == [(2, 8), (2, 4)]
    assert batches[0].batch.segment_ids.tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 6 + [0] * 2]
    assert batches[0].stats.padded_tokens == 16 - 9
    assert batches[1].stats.rows_used == 1


def test_overlong_error_names_the_example():
    config = PackingConfig(buckets=(8, 16), rows_per_batch=2)
    with pytest.raises(
        ValueError, match=r"data\.jsonl:3: example of 20 tokens.*overlong='truncate'"
    ):
        list(pack_units([(_seq(20, origin="data.jsonl:3"),)], config))


def test_overlong_truncation_is_counted():
    config = PackingConfig(buckets=(8, 16), rows_per_batch=2, overlong="truncate")
    batches = list(pack_units([(_seq(20, start=5),), (_seq(4),), (_seq(30),)], config))
    # 20 -> 16 (4 cut), fills row 0; 4 -> row 1; 30 -> 16 (14 cut) does not fit -> next batch.
    assert [b.stats.truncated_units for b in batches] == [1, 1]
    assert [b.stats.truncated_tokens for b in batches] == [4, 14]
    assert batches[0].batch.tokens[0].tolist() == list(range(5, 21))  # the head is kept


def test_pairs_stay_adjacent_and_truncate_longest_first():
    config = PackingConfig(
        buckets=(16,), rows_per_batch=2, overlong="truncate", max_segments_per_row=4
    )
    pair_a = (_seq(12, start=100), _seq(9, start=200))  # 21 > 16: cap 8 -> 8 + 8, 5 cut
    pair_b = (_seq(3, start=300), _seq(4, start=400))
    pair_c = (_seq(2, start=500), _seq(3, start=600))
    (packed,) = list(pack_units([pair_a, pair_b, pair_c], config))
    seg = packed.batch.segment_ids
    # Row 0: pair a (segments 1, 2). Row 1: pair b (3, 4 tokens) then pair c (2, 3 tokens).
    assert seg[0].tolist() == [1] * 8 + [2] * 8
    assert seg[1].tolist() == [1] * 3 + [2] * 4 + [3] * 2 + [4] * 3 + [0] * 4
    assert packed.stats.truncated_units == 1 and packed.stats.truncated_tokens == 5
    # Pairs are placed as two consecutive sequences; the truncated pair with its cut lengths.
    assert [(p.row, p.segment, p.start, p.length) for p in packed.placements] == [
        (0, 1, 0, 8), (0, 2, 8, 8), (1, 1, 0, 3), (1, 2, 3, 4), (1, 3, 7, 2), (1, 4, 9, 3)
    ]
    # Losses read chosen from odd and rejected from even segments: sum token ids as "logprobs".
    batch = packed.batch
    values = jnp.asarray(batch.tokens, jnp.float32)
    sequences = sequence_logprobs(values, batch.loss_mask, batch.segment_ids, 4)
    pairs = preference_pairs(sequences)
    # Targets exclude each sequence's first token: pair a chosen 101..107, rejected 201..207.
    expected_chosen = [sum(range(101, 108)), sum(range(501, 502)), sum(range(301, 303)), 0]
    expected_rejected = [sum(range(201, 208)), sum(range(601, 603)), sum(range(401, 404)), 0]
    # Pair order: row-major over (row, pair-in-row): (0,0)=a, (0,1)=none, (1,0)=b, (1,1)=c.
    np.testing.assert_allclose(
        np.asarray(pairs.chosen), [expected_chosen[0], 0, expected_chosen[2], expected_chosen[1]]
    )
    np.testing.assert_allclose(
        np.asarray(pairs.rejected),
        [expected_rejected[0], 0, expected_rejected[2], expected_rejected[1]],
    )
    assert np.asarray(pairs.mask).tolist() == [True, False, True, True]


def test_pairs_need_even_segment_limit_and_one_unit_size():
    packer = BatchPacker(PackingConfig(buckets=(16,), max_segments_per_row=3))
    with pytest.raises(ValueError, match="multiple of the unit size 2"):
        packer.add((_seq(2), _seq(2)))
    packer = BatchPacker(PackingConfig(buckets=(16,)))
    packer.add((_seq(2),))
    with pytest.raises(ValueError, match="unit of 2 sequences in a stream of 1-sequence"):
        packer.add((_seq(2), _seq(2)))


def test_extra_float_arrays_are_packed():
    config = PackingConfig(buckets=(8,), rows_per_batch=1)
    units = [
        (_seq(3, behavior_logprobs=np.array([0.0, -0.5, -0.25])),),
        (_seq(2, behavior_logprobs=np.array([0.0, -2.0])),),
    ]
    (packed,) = list(pack_units(units, config))
    np.testing.assert_allclose(
        packed.batch.behavior_logprobs, [[0.0, -0.5, -0.25, 0.0, -2.0, 0, 0, 0]]
    )
    assert packed.batch.advantages is None
    mixed = [units[0], (_seq(2, origin="b.jsonl:2"),)]
    with pytest.raises(ValueError, match="b.jsonl:2: has no behavior_logprobs"):
        list(pack_units(mixed, config))


def test_train_batch_target_mask_and_shape_check():
    batch = TrainBatch(
        tokens=np.array([[5, 6, 7, 8]]),
        positions=np.array([[0, 1, 0, 1]]),
        segment_ids=np.array([[1, 1, 2, 2]]),
        loss_mask=np.array([[1, 1, 1, 1]], bool),
    )
    assert np.asarray(target_mask(batch.loss_mask, batch.segment_ids)).tolist() == [
        [False, True, False, True]
    ]
    with pytest.raises(ValueError, match="advantages has shape"):
        TrainBatch(
            tokens=batch.tokens,
            positions=batch.positions,
            segment_ids=batch.segment_ids,
            loss_mask=batch.loss_mask,
            advantages=np.zeros((1, 3)),
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buckets": (16, 8)},
         r"^PackingConfig\.buckets=\(16, 8\) is invalid; expected strictly increasing lengths, "
         r"e\.g\. \[8, 16\]"),
        ({"buckets": ()}, r"^PackingConfig\.buckets=\(\) is invalid; expected a non-empty list"),
        ({"rows_per_batch": 0},
         r"^PackingConfig\.rows_per_batch=0 is invalid; expected an int >= 1"),
        ({"mode": "stack"}, r"^PackingConfig\.mode='stack' is invalid; expected one of 'pack', 'pad'"),
        ({"overlong": "drop"},
         r"^PackingConfig\.overlong='drop' is invalid; expected one of 'error', 'truncate'"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PackingConfig(**kwargs)


def _episodes(lengths):
    return [(TokenSequence(tokens=np.arange(n, dtype=np.int32) % 50 + 1,
                           loss_mask=np.ones(n, bool), origin=f"episode {i}"),)
            for i, n in enumerate(lengths)]


def test_least_padding_keeps_the_batch_count_and_shortens_rows():
    # An RL step of 32 episodes of 72 tokens: first-fit fills 5 of 16 rows of 512 (28% of the
    # batch holds tokens); rows of 256 hold the step in the same single batch (11 rows, 56%).
    cfg = PackingConfig(buckets=(64, 128, 256, 512), rows_per_batch=16, max_segments_per_row=16)
    units = _episodes([72] * 32)
    first_fit = list(pack_units(units, cfg))
    assert [p.batch.tokens.shape for p in first_fit] == [(16, 512)]
    tight = pack_least_padding(units, cfg)
    assert [p.batch.tokens.shape for p in tight] == [(16, 256)]
    assert tight[0].stats.rows_used == 11 and tight[0].stats.real_tokens == 32 * 72
    assert tight[0].stats.padded_tokens == 16 * 256 - 32 * 72
    # Every episode is placed whole, once.
    placed = sorted((p.row, p.start, p.length) for p in tight[0].placements)
    assert len(placed) == 32 and all(length == 72 for _, _, length in placed)
    rows = {row: [s for r, s, _ in placed if r == row] for row, _, _ in placed}
    assert all(starts == [0, 72, 144][:len(starts)] for starts in rows.values())
    # Rows of 128 would need two batches (two optimizer steps instead of one): not taken.
    assert len(list(pack_units(units, PackingConfig(buckets=(64, 128), rows_per_batch=16,
                                                    max_segments_per_row=16)))) == 2


def test_least_padding_skips_buckets_shorter_than_an_episode():
    cfg = PackingConfig(buckets=(64, 128, 512), rows_per_batch=4, max_segments_per_row=4)
    tight = pack_least_padding(_episodes([100, 20, 20]), cfg)
    assert [p.batch.tokens.shape for p in tight] == [(4, 128)]
    assert pack_least_padding([], cfg) == []
