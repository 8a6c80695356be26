#!/usr/bin/env python3
"""Generate tests/goldens/template_expected.json (run ONCE; the output is committed).

    /opt/pyref/bin/python scripts/template_goldens.py

Requires transformers (tested with 5.17.0), jinja2 (3.1.6) and tokenizers.  Every render goes
through transformers' own `apply_chat_template(..., tokenize=False)` with the vendored Qwen3.6
template (src/tokenizer/chat_template.jinja), i.e. the ImmutableSandboxedEnvironment with
trim_blocks/lstrip_blocks, transformers' `tojson`, `raise_exception` and `strftime_now`.  The
tokenizer object is a stub: the Qwen3.6 template only reads messages/tools/kwargs.

Error cases are rendered with transformers' compiled template directly (apply_chat_template
rejects an empty conversation before the template runs) and record the template's message.
"""

import json
import pathlib

from tokenizers import Tokenizer
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast
import transformers
from transformers.utils.chat_template_utils import _compile_jinja_template

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATE = (ROOT / "src/tokenizer/chat_template.jinja").read_text(encoding="utf-8")
OUT = ROOT / "tests/goldens/template_expected.json"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city. Use <city> & 'units' carefully — température!",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.\nReturns JSON.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
            "required": ["query"],
        },
    },
}

CASES = [
    {
        "name": "system_user",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. Réponds en français si besoin."},
            {"role": "user", "content": "Hello! 你好 👋 What is 2+2?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "user_only_no_kwargs",
        "messages": [{"role": "user", "content": "Hi"}],
        "add_generation_prompt": True,
    },
    {
        "name": "enable_thinking_false",
        "messages": [{"role": "user", "content": "Hi"}],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": False},
    },
    {
        "name": "enable_thinking_true",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": True},
    },
    {
        "name": "multi_turn_reasoning_history",
        "messages": [
            {"role": "system", "content": "You are a math tutor."},
            {"role": "user", "content": "What is 3*7?"},
            {"role": "assistant", "content": "3*7 = 21.", "reasoning_content": "Multiply 3 by 7.\nThat is 21."},
            {"role": "user", "content": "And 21+1?"},
            {"role": "assistant", "content": "<think>\nAdd one to 21.\n</think>\n\n21+1 = 22."},
            {"role": "user", "content": "Thanks. Now 22/2?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "reasoning_after_last_query",
        "messages": [
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": "First answer", "reasoning_content": "old thoughts"},
            {"role": "user", "content": "Second question"},
            {"role": "assistant", "content": "<think>new thoughts</think>Second answer"},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "preserve_thinking_true",
        "messages": [
            {"role": "user", "content": "What is 3*7?"},
            {"role": "assistant", "content": "21.", "reasoning_content": "3 times 7."},
            {"role": "user", "content": "And plus one?"},
            {"role": "assistant", "content": "<think>\n\n21 plus 1\n\n</think>\n\n22."},
            {"role": "user", "content": "Great."},
        ],
        "add_generation_prompt": True,
        "kwargs": {"preserve_thinking": True, "enable_thinking": True},
    },
    {
        "name": "empty_reasoning_current_turn",
        "messages": [
            {"role": "user", "content": "Quick one"},
            {"role": "assistant", "content": "Sure.", "reasoning_content": ""},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "tools_with_calls_and_responses",
        "messages": [
            {"role": "system", "content": "  You can call tools.  \n"},
            {"role": "user", "content": "Weather in Paris and Tokyo? Also search for news."},
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "Need two weather calls and one search.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "units": "celsius", "days": 3}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京", "days": 1.5, "verbose": True, "extra": None}}},
                    {"type": "function", "function": {"name": "search", "arguments": {"query": "news <today> & 'more'", "filters": {"lang": "fr", "sites": ["a.com", "b.org"], "safe": False}, "limit": [1, 2.0, -3e-7, 1e22]}}},
                ],
            },
            {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
            {"role": "tool", "content": "{\"temp\": 18, \"sky\": \"雨\"}"},
            {"role": "tool", "content": "Top story: <b>Rust 2.0</b> released"},
            {"role": "assistant", "content": "Paris is 21°C and clear; Tokyo is 18°C with rain."},
            {"role": "user", "content": "Thanks!"},
        ],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "tools_multi_step_pending",
        "messages": [
            {"role": "user", "content": "What's the weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]},
            {"role": "tool", "content": "{\"temp\": -2}"},
            {"role": "assistant", "content": "<think>\nCheck tomorrow too.\n</think>\n\n", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
            {"role": "tool", "content": "{\"temp\": 0}"},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": False},
    },
    {
        "name": "tools_no_system_message",
        "messages": [{"role": "user", "content": "Search cats"}],
        "tools": [SEARCH_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "no_generation_prompt",
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "hi"},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "text_part_arrays",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "System "}, {"type": "text", "text": "in parts."}]},
            {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image", "image": "file:///a.png"}, {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": "http://x/b.png"}}, {"type": "video", "video": "v.mp4"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Two images and a video."}]},
            {"role": "user", "content": [{"type": "text", "text": "Another "}, {"type": "image"}]},
        ],
        "add_generation_prompt": True,
        "kwargs": {"add_vision_id": True},
    },
    {
        "name": "whitespace_and_python_trim",
        "messages": [
            {"role": "user", "content": "\u001f \t  padded user\u00a0 \n\n"},
            {"role": "assistant", "content": "\n\n  answer with spaces  \n"},
            {"role": "user", "content": "<tool_response>\nlooks like a tool\n</tool_response>"},
        ],
        "add_generation_prompt": True,
    },
]

ERROR_CASES = [
    {"name": "empty_messages", "messages": [], "expect": "No messages provided."},
    {
        "name": "system_with_image",
        "messages": [
            {"role": "system", "content": [{"type": "image", "image": "x.png"}]},
            {"role": "user", "content": "hi"},
        ],
        "expect": "System message cannot contain images.",
    },
    {
        "name": "system_not_first",
        "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
        "expect": "System message must be at the beginning.",
    },
    {"name": "no_user_query", "messages": [{"role": "system", "content": "only system"}], "expect": "No user query found in messages."},
    {
        "name": "unexpected_role",
        "messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}],
        "expect": "Unexpected message role.",
    },
    {"name": "unexpected_content_type", "messages": [{"role": "user", "content": 42}], "expect": "Unexpected content type."},
    {
        "name": "unexpected_item_type",
        "messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}],
        "expect": "Unexpected item type in content.",
    },
]


def main():
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(BPE()), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    cases = []
    for c in CASES:
        rendered = tok.apply_chat_template(
            c["messages"],
            tools=c.get("tools"),
            chat_template=TEMPLATE,
            tokenize=False,
            add_generation_prompt=c["add_generation_prompt"],
            **c.get("kwargs", {}),
        )
        cases.append({
            "name": c["name"],
            "messages": c["messages"],
            "tools": c.get("tools"),
            "add_generation_prompt": c["add_generation_prompt"],
            "kwargs": c.get("kwargs", {}),
            "expected": rendered,
        })

    compiled = _compile_jinja_template(TEMPLATE)
    errors = []
    for c in ERROR_CASES:
        try:
            compiled.render(messages=c["messages"], tools=None, documents=None, add_generation_prompt=True)
        except Exception as e:  # jinja2 TemplateError from raise_exception
            assert str(e) == c["expect"], (c["name"], str(e))
        else:
            raise AssertionError(f"{c['name']} rendered without error")
        errors.append({"name": c["name"], "messages": c["messages"], "error": c["expect"]})

    OUT.write_text(
        json.dumps({"generator": f"transformers {transformers.__version__} apply_chat_template",
                    "cases": cases, "errors": errors}, ensure_ascii=False, indent=1) + "\n",
        encoding="utf-8",
    )
    print(f"wrote {len(cases)} cases and {len(errors)} error cases to {OUT}")


if __name__ == "__main__":
    main()
