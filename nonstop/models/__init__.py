"""Models: configs and presets, the decoder, Hugging Face checkpoints, tokenizers, sharding."""

from nonstop.models.chat import ChatTemplate, Message, ToolCall
from nonstop.models.chat_templates import CHAT_FORMATS, ChatFormat
from nonstop.models.checkpoint import load_pretrained, save_pretrained
from nonstop.models.config import ConfigError, ModelConfig, RopeConfig
from nonstop.models.conversation import Conversation
from nonstop.models.decoder import Decoder, KVCache, abstract_decoder, init_decoder
from nonstop.models.safetensors_io import CheckpointError
from nonstop.models.sharding import (
    DEFAULT_RULES,
    MESH_AXES,
    ShardingRules,
    make_mesh,
    param_shardings,
    shard_model,
)
from nonstop.models.tokenizer import Tokenizer

__all__ = [
    "CHAT_FORMATS",
    "ChatFormat",
    "ChatTemplate",
    "Conversation",
    "Message",
    "Tokenizer",
    "ToolCall",
    "DEFAULT_RULES",
    "MESH_AXES",
    "CheckpointError",
    "ConfigError",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "RopeConfig",
    "ShardingRules",
    "abstract_decoder",
    "init_decoder",
    "load_pretrained",
    "make_mesh",
    "param_shardings",
    "save_pretrained",
    "shard_model",
]
