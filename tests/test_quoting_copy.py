"""The planted cycle and the copy prompt of tests/test_engine_quoting_gpu.py (quoting_copy.py),
on the CPU: the cycle's choice, the planted rows in a real synthesized checkpoint that `prepare`
then takes, the cycle holding through the tiny model's own layers (transformers' Qwen3.5 with
the weights the GPU test serves, before quantization), and the repeat counts the summary keeps."""

from __future__ import annotations

import json

import pytest
import torch
from quoting_copy import (
    CYCLE_LENGTH,
    EMBEDDING,
    INDEX,
    LM_HEAD,
    PLANTED_RMS,
    copy_prompt,
    copyable_tokens,
    cycle_tokens,
    plant_cycle,
    planted_embeddings,
    repeats_its_context,
)
from safetensors.torch import load_file
from test_engine_quoting_gpu import NEAR_TIE
from test_prepare_common import GEOMETRY, copy_base, run_prepare, tiny_base_dir

from hyperqwen.checkpoint import config_json, layout
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import initial_value
from hyperqwen.checkpoint.tokenizer import SPECIAL_TOKEN_IDS
from hyperqwen.engine.lookup import LONG_MATCH


def test_cycle_tokens_are_distinct_ordinary_seeded_and_avoid_the_given_ones():
    first = cycle_tokens(avoid=[])
    avoided = first[:10]
    second = cycle_tokens(avoid=avoided)
    assert len(set(first)) == len(first) == CYCLE_LENGTH
    assert max(first) < min(SPECIAL_TOKEN_IDS.values())
    assert cycle_tokens(avoid=[]) == first
    assert not set(second) & set(avoided) and len(second) == CYCLE_LENGTH
    assert cycle_tokens(avoid=[], seed=1) != first


def test_planted_rows_make_each_cycle_token_predict_the_next_by_a_wide_margin():
    generator = torch.Generator().manual_seed(5)
    head = torch.randn(5000, PRESETS["tiny"].hidden_size, generator=generator) * 0.02
    cycle = [17, 4000, 3, 2500, 999]
    rows = planted_embeddings(head, cycle, PLANTED_RMS)
    assert torch.allclose(rows.pow(2).mean(dim=1).sqrt(), torch.full((5,), PLANTED_RMS))
    logits = (rows / rows.pow(2).mean(dim=1, keepdim=True).sqrt()) @ head.T
    top = logits.topk(2, dim=1)
    assert top.indices[:, 0].tolist() == [*cycle[1:], cycle[0]]
    assert (top.values[:, 0] - top.values[:, 1]).min() > 10 * NEAR_TIE


def test_plant_cycle_rewrites_only_the_cycle_rows_and_prepare_takes_the_result(tmp_path_factory):
    base = tiny_base_dir(tmp_path_factory)
    model = copy_base(base, tmp_path_factory.mktemp("planted") / "model")
    weight_map = json.loads((base / INDEX).read_text())["weight_map"]
    before = load_file(base / weight_map[EMBEDDING])[EMBEDDING].clone()
    head = load_file(base / weight_map[LM_HEAD])[LM_HEAD]
    cycle = cycle_tokens(avoid=[])

    plant_cycle(model, cycle)

    after = load_file(model / weight_map[EMBEDDING])[EMBEDDING]
    expected = planted_embeddings(head, cycle, PLANTED_RMS).to(after.dtype)
    assert torch.equal(after[cycle], expected)
    others = torch.ones(after.shape[0], dtype=torch.bool)
    others[cycle] = False
    assert torch.equal(after[others], before[others])
    # the base's shard (a hard link in the copy) is untouched
    assert torch.equal(load_file(base / weight_map[EMBEDDING])[EMBEDDING], before)
    assert after.shape == (GEOMETRY.vocab_size, GEOMETRY.hidden_size)
    code, out, err = run_prepare(str(model), "--quiet")
    assert code == 0, err + out


def tiny_language_model(seed: int = 0):
    """transformers' Qwen3.5 text model with the tiny preset's synthesized weights (the bf16
    values `synthesize` quantizes), in float32."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    geometry = PRESETS["tiny"]
    text_config = dict(config_json.build_config(geometry)["text_config"])
    text_config.pop("model_type")
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_config)).eval()
    weights = {
        spec.name.replace("model.language_model.", "model."): initial_value(spec, seed).float()
        for spec in layout.checkpoint_layout(geometry)
        if not spec.name.startswith("mtp.")
    }
    model.load_state_dict(weights, strict=True)
    return model


def test_the_tiny_models_greedy_answer_to_the_copy_prompt_goes_around_the_planted_cycle():
    model = tiny_language_model()
    embedding = model.model.embed_tokens.weight.data
    cycle = cycle_tokens(avoid=[])
    prompt = copy_prompt(cycle)
    steps = CYCLE_LENGTH // 2 + 8  # past the wrap from the cycle's last token to its first
    generate = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    with torch.no_grad():
        unplanted = model.generate(torch.tensor([prompt]), **generate)[0, len(prompt) :]
        embedding[cycle] = planted_embeddings(model.lm_head.weight.data, cycle, PLANTED_RMS)
        out = model.generate(
            torch.tensor([prompt]), output_scores=True, return_dict_in_generate=True, **generate
        )
    answer = out.sequences[0, len(prompt) :].tolist()
    around = [cycle[(len(prompt) + i) % CYCLE_LENGTH] for i in range(steps)]
    assert answer == around
    margins = [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores)]
    assert min(margins) > 10 * NEAR_TIE
    assert repeats_its_context(prompt, answer)
    # the random model as synthesized does not copy: the planting is what makes it
    assert unplanted.tolist() != around
    assert not repeats_its_context(prompt, unplanted.tolist())


@pytest.mark.parametrize(
    ("prompt", "answer", "copyable", "repeats"),
    [
        # the answer goes on as the prompt went: every token after the first n is copyable
        (list(range(10)) * 2, list(range(10)), 10, True),
        # no n tokens occur twice
        (list(range(20)), list(range(100, 110)), 0, False),
        # the n tokens recur but what followed them last time differs
        ([*range(LONG_MATCH), 50, *range(LONG_MATCH)], [60], 0, False),
        # the answer's own repeats count (the search sees the answer so far): the second period's
        # last 2 tokens (its first n-gram is new) and all of the third period's
        ([1000], [*range(LONG_MATCH + 2)] * 3, LONG_MATCH + 4, True),
    ],
)
def test_copyable_tokens_and_repeats(prompt, answer, copyable, repeats):
    assert copyable_tokens(prompt, answer) == copyable
    assert repeats_its_context(prompt, answer) is repeats
