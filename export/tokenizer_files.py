"""The byte tokenizer (contract/tokenizer.py, byte-v1) written as Hugging Face `tokenizers` files: tokenizer.json and
tokenizer_config.json, which onnxruntime-genai (through onnxruntime-extensions) and `tokenizers` read.

A byte-level BPE with no merges: every byte is one token, spelt with GPT-2's printable stand-in for the byte, id byte
+ 4 after the four special tokens; the post-processor prepends BOS, as ByteTokenizer.encode does. Torch-free."""

from __future__ import annotations

import json

from contract.tokenizer import BOS_ID, EOS_ID, NUM_SPECIAL, PAD_ID, SPECIAL_NAMES, UNK_ID

SPECIAL_TOKENS = dict(enumerate(SPECIAL_NAMES))


def byte_symbols() -> list[str]:
    """The printable character that stands for each byte 0..255 in byte-level BPE vocabularies (GPT-2's scheme:
    printable Latin-1 bytes stand for themselves, the others for the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _byte_level(kind: str) -> dict[str, object]:
    return {"type": kind, "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def tokenizer_json() -> dict[str, object]:
    """tokenizer.json's contents for byte-v1."""
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in SPECIAL_TOKENS.items()
    ]
    bos = SPECIAL_TOKENS[BOS_ID]
    vocab = {token: i for i, token in SPECIAL_TOKENS.items()}
    vocab.update({symbol: b + NUM_SPECIAL for b, symbol in enumerate(byte_symbols())})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _byte_level("ByteLevel"),
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}},
        },
        "decoder": _byte_level("ByteLevel"),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


# The byte-level models' chat template (Jinja, as Hugging Face's, vLLM and ORT GenAI read it): a line per message,
# "role: content", then "assistant:" for the reply. BOS is the tokenizer's, so the template writes none.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tokenizer_config_json(max_len: int) -> dict[str, object]:
    """tokenizer_config.json's contents: the class runtimes pick a loader by, the special tokens, BOS added."""
    return {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "add_bos_token": True,
        "add_eos_token": False,
        "add_prefix_space": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def tokenizer_files(max_len: int) -> dict[str, bytes]:
    """File name -> contents, for an export's folder."""
    from contract.decoder_metadata import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

    return {
        TOKENIZER_FILE: (json.dumps(tokenizer_json(), ensure_ascii=False, indent=1) + "\n").encode(),
        TOKENIZER_CONFIG_FILE: (json.dumps(tokenizer_config_json(max_len), indent=2) + "\n").encode(),
    }
