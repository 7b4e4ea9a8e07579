"""Tool-call parsers for agent episodes: the assistant's text → ToolCalls plus parse errors.

They live in `nonstop.models.tool_parsers` (the server reads the same formats); this module keeps
the agentic layer's names. Formats: hermes (qwen), llama3_json (llama3), llama4_pythonic, mistral,
deepseek_v3, gemma; a malformed call is a `ParseError` whose `observation()` the model sees.
"""

from nonstop.models.tool_parsers import (
    TOOL_PARSERS,
    DeepSeekV3Parser,
    GemmaParser,
    HermesParser,
    Llama3JsonParser,
    Llama3Parser,
    Llama4PythonicParser,
    MistralParser,
    ParsedTurn,
    ParseError,
    QwenParser,
    ToolCallParser,
    call_from_object,
    get_parser,
    parse_tool_calls,
    parser_name_for,
)

__all__ = ["TOOL_PARSERS", "DeepSeekV3Parser", "GemmaParser", "HermesParser", "Llama3JsonParser",
           "Llama3Parser", "Llama4PythonicParser", "MistralParser", "ParseError", "ParsedTurn",
           "QwenParser", "ToolCallParser", "call_from_object", "get_parser", "parse_tool_calls",
           "parser_name_for"]
