"""Weights into vLLM's worker processes: both ends of `VLLMEngine.update_weights`.

In the engine's process, `weight_chunks` converts an NNX parameter state to Hugging Face names
and layouts (`weight_transfer.hf_weights`, LoRA and quantized weights merged) and packs the host
arrays as raw bytes into chunks of at most `chunk_bytes`; `send_weights` hands them to every
worker over vLLM's collective RPC. In each worker, `WorkerExtension` (mixed into vLLM's worker
class through `worker_extension_cls=WORKER_EXTENSION_CLS`) stages the chunks, then reloads them
in place. No file is written. vLLM is imported only inside the worker's methods, so importing
this module needs no vLLM.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from flax import nnx

from nonstop.engine.weight_transfer import hf_weights

# One message of an update: (Hugging Face name, dtype name, shape, raw bytes) per tensor.
WeightChunk = list[tuple[str, str, list[int], bytes]]


def weight_chunks(
    graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, dtype: np.dtype, chunk_bytes: int
) -> list[WeightChunk]:
    """`params` as Hugging Face tensors of `dtype`, in chunks of at most `chunk_bytes` (a
    larger tensor gets a chunk of its own); a state that does not fit the model is a ValueError."""
    chunks: list[WeightChunk] = [[]]
    size = 0
    try:
        for name, array in hf_weights(graphdef, params, rest, dtype):
            if size and size + array.nbytes > chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append((name, array.dtype.name, list(array.shape), array.tobytes()))
            size += array.nbytes
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(
            f"update_weights: params do not fit this engine's model "
            f"({type(error).__name__}: {error}); pass the state of the "
            "model's nnx.Param variables (nnx.state(model, nnx.Param))"
        ) from error
    return chunks


async def send_weights(llm: Any, chunks: list[WeightChunk]) -> None:
    """Stage `chunks` in every worker of vLLM's `AsyncLLM` `llm`, then reload them in place."""
    for chunk in chunks:
        await llm.collective_rpc("nonstop_stage_weights", args=(chunk,))
    await llm.collective_rpc("nonstop_load_staged")


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): receives weight chunks and
    reloads them in place. Runs in vLLM's worker processes."""

    def nonstop_stage_weights(self, chunk: WeightChunk) -> int:
        import torch

        staged = self.__dict__.setdefault("_nonstop_staged", [])
        with warnings.catch_warnings():  # the bytes are read-only; load_weights copies them
            warnings.simplefilter("ignore", UserWarning)
            for name, dtype, shape, data in chunk:
                if dtype == "bfloat16":  # numpy has no bfloat16 of its own: move the bits
                    bits = np.frombuffer(data, dtype=np.uint16).reshape(shape)
                    staged.append((name, torch.from_numpy(bits).view(torch.bfloat16)))
                else:
                    array = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
                    staged.append((name, torch.from_numpy(array)))
        return len(staged)

    def nonstop_load_staged(self) -> int:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        staged = self.__dict__.pop("_nonstop_staged", [])
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        self.model_runner.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter(staged), is_checkpoint_format=True
        )
        # On CPU an embedding keeps a prepacked copy of its weight for when it is also the
        # output layer (tied embeddings); vLLM 0.32's in-place reload leaves that copy on the
        # old weights, so repack it from the new ones.
        for module in model.modules():
            if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                module.quant_method.process_weights_after_loading(module)
        return len(staged)


WORKER_EXTENSION_CLS = f"{__name__}.WorkerExtension"

__all__ = [
    "WORKER_EXTENSION_CLS",
    "WeightChunk",
    "WorkerExtension",
    "send_weights",
    "weight_chunks",
]
