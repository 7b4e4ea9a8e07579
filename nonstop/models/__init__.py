"""Models: configs and presets, the decoder, the Gemma 3 vision-language model, Hugging Face
checkpoints, tokenizers, image processing, sharding."""

from nonstop.models.chat import ChatTemplate, Message, ToolCall
from nonstop.models.chat_templates import CHAT_FORMATS, ChatFormat
from nonstop.models.checkpoint import load_pretrained, save_pretrained
from nonstop.models.config import ConfigError, ModelConfig, RopeConfig
from nonstop.models.conversation import Conversation
from nonstop.models.decoder import Decoder, KVCache, abstract_decoder, init_decoder
from nonstop.models.image_processor import ImageError, ImageProcessor
from nonstop.models.multimodal import Gemma3VLM, VLMConfig, init_vlm
from nonstop.models.peft_format import load_adapters, save_adapters
from nonstop.models.safetensors_io import CheckpointError
from nonstop.models.sharding import (
    DEFAULT_RULES,
    MESH_AXES,
    MeshShape,
    ShardingRules,
    make_mesh,
    param_shardings,
    shard_model,
)
from nonstop.models.source import ModelSource, TokenizerSource, build_model, build_tokenizer
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.vision import VisionConfig, apply_vision_lora, merge_vision_lora

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
    "Gemma3VLM",
    "ImageError",
    "ImageProcessor",
    "KVCache",
    "ModelConfig",
    "RopeConfig",
    "ShardingRules",
    "VLMConfig",
    "VisionConfig",
    "abstract_decoder",
    "apply_vision_lora",
    "init_decoder",
    "init_vlm",
    "load_adapters",
    "load_pretrained",
    "MeshShape",
    "ModelSource",
    "TokenizerSource",
    "build_model",
    "build_tokenizer",
    "make_mesh",
    "merge_vision_lora",
    "param_shardings",
    "save_adapters",
    "save_pretrained",
    "shard_model",
]
