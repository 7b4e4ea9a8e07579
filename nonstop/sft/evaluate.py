"""Held-out evaluation for supervised and preference tuning: greedy answers and pair accuracy.

- `greedy_generate`: batched greedy decoding with the decoder's KV cache — one prefill of all
  prompts (right-padded; padding positions are parked past the cache so they write nothing), then
  one jitted decode step per new token. Weights enter the jitted functions as arguments.
- `greedy_chat_answers`: the assistant replies to one-turn user prompts, via the chat template.
- `preference_accuracy`: the fraction of (chosen, rejected) pairs whose chosen response the model
  gives the higher summed log-probability — the held-out measure DPO and ORPO should raise.

This is a small evaluation loop for tests and recipes, not the inference engine (nonstop/engine);
the supervised trainer's layer does not depend on the engine.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nonstop.models.conversation import Conversation
from nonstop.models.decoder import KVCache
from nonstop.models.tokenizer import Tokenizer
from nonstop.sft.losses import preference_pairs, sequence_logprobs
from nonstop.train.batch import TrainBatch
from nonstop.train.logprobs import token_logprobs


def greedy_generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Collection[int],
) -> list[list[int]]:
    """Greedy continuations of `prompts` (token ids), each ending at its first stop id
    (included) or after `max_new_tokens`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate needs at least one prompt, none of them empty")
    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts])
    prompt_len = int(lengths.max())
    max_len = prompt_len + max_new_tokens
    graphdef, weights = nnx.split(model)

    @jax.jit
    def forward(weights: nnx.State, tokens: jax.Array, positions: jax.Array, cache: KVCache
             ) -> tuple[jax.Array, KVCache]:
        return nnx.merge(graphdef, weights)(tokens, positions, cache=cache)

    cache = KVCache.create(model.cfg, num_slots=batch, max_len=max_len, dtype=model.dtype)

    tokens = np.zeros((batch, prompt_len), np.int32)
    positions = np.full((batch, prompt_len), max_len, np.int32)  # parked: writes nothing
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
        positions[row, : len(prompt)] = np.arange(len(prompt))
    logits, cache = forward(weights, tokens, positions, cache)
    next_tokens = np.asarray(jnp.argmax(logits[np.arange(batch), lengths - 1], axis=-1))

    outputs: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    stop = set(int(i) for i in stop_ids)
    for step in range(max_new_tokens):
        for row in np.flatnonzero(~done):
            token = int(next_tokens[row])
            outputs[row].append(token)
            done[row] = token in stop
        if done.all() or step == max_new_tokens - 1:
            break
        current = np.where(done, max_len, lengths + step).astype(np.int32)[:, None]
        logits, cache = forward(weights, next_tokens[:, None].astype(np.int32), current, cache)
        next_tokens = np.asarray(jnp.argmax(logits[:, -1], axis=-1))
    return outputs


def greedy_chat_answers(
    model: nnx.Module, tokenizer: Tokenizer, prompts: Sequence[str], *, max_new_tokens: int
) -> list[str]:
    """The model's greedy reply to each one-turn user prompt, special tokens removed."""
    ids = []
    for prompt in prompts:
        conversation = Conversation(tokenizer, None)
        conversation.append_messages([{"role": "user", "content": prompt}])
        ids.append(conversation.generation_prompt_tokens())
    outputs = greedy_generate(model, ids, max_new_tokens=max_new_tokens,
                              stop_ids=tokenizer.eos_ids)
    return [tokenizer.decode(out, skip_special_tokens=True) for out in outputs]


def preference_accuracy(
    model: nnx.Module, batches: Iterable[TrainBatch], *, num_segments: int
) -> float:
    """Fraction of valid pairs in `batches` where log p(chosen) > log p(rejected) (summed)."""
    graphdef, weights = nnx.split(model)

    @jax.jit
    def pairs_of(weights: nnx.State, batch: TrainBatch) -> tuple[jax.Array, ...]:
        logits, _ = nnx.merge(graphdef, weights)(batch.tokens, batch.positions, batch.segment_ids)
        sequences = sequence_logprobs(token_logprobs(logits, batch.tokens), batch.loss_mask,
                                      batch.segment_ids, num_segments)
        pairs = preference_pairs(sequences)
        return pairs.chosen, pairs.rejected, pairs.mask

    wins = total = 0
    for batch in batches:
        chosen, rejected, mask = pairs_of(weights, batch)
        mask = np.asarray(mask)
        wins += int(np.sum((np.asarray(chosen) > np.asarray(rejected)) & mask))
        total += int(np.sum(mask))
    if total == 0:
        raise ValueError("preference_accuracy: the batches hold no valid (chosen, rejected) pair")
    return wins / total
