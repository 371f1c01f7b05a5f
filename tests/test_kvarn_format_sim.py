"""kvarn/format_sim.py: its attention against transformers' own on a tiny random Llama, the
read rules (what a query reads from the store), the parsing of cache names and the code text."""

from __future__ import annotations

import sys

import pytest
import torch

from hyperqwen.kvarn.format_sim import (
    ATTENTION,
    Cache,
    main,
    perplexity,
    quantized_reads,
    register,
    stored,
    tokenize_code,
)
from hyperqwen.kvarn.layout import TILE_TOKENS
from hyperqwen.kvarn.quantize import dequantize_tile, quantize_tile

LENGTH = 2 * TILE_TOKENS + 60  # the sink, one full tile past it and a filling one


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024)  # fmt: skip
    register()
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(1))
    return model, ids.tolist()


def logits(model, ids, implementation: str, cache: Cache | None = None) -> torch.Tensor:
    model.config._attn_implementation = implementation
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False, kv_cache_read=cache).logits


def test_exact_reads_are_transformers_own_attention(tiny_llama) -> None:
    model, ids = tiny_llama
    ours = logits(model, ids, ATTENTION, Cache("exact"))
    torch.testing.assert_close(ours, logits(model, ids, "eager"), rtol=1e-4, atol=1e-4)


def test_kvarn_changes_only_what_is_read_from_the_store(tiny_llama) -> None:
    model, ids = tiny_llama
    exact = logits(model, ids, ATTENTION, Cache("exact"))
    # every tile read in 16 bits: nothing from the store
    unread = logits(model, ids, ATTENTION, Cache("kvarn", recent_tiles=3))
    torch.testing.assert_close(unread, exact, rtol=1e-5, atol=1e-5)
    served = logits(model, ids, ATTENTION, Cache("kvarn"))
    # the sink and the first full tile's own queries read nothing stored: their logits agree
    torch.testing.assert_close(served[0, : 2 * TILE_TOKENS], exact[0, : 2 * TILE_TOKENS],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert not torch.allclose(served[0, 2 * TILE_TOKENS :], exact[0, 2 * TILE_TOKENS :])
    model.config._attn_implementation = ATTENTION
    assert perplexity(model, ids, Cache("kvarn")) != perplexity(model, ids, Cache("exact"))


def test_the_store_is_the_reference_quantizer_tile_by_tile() -> None:
    generator = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 1, 2, LENGTH, 32, generator=generator)
    for v_bits in (2, 3):
        k_read, v_read = stored(k, v, v_bits)
        tile = slice(TILE_TOKENS, 2 * TILE_TOKENS)
        k_want, v_want = dequantize_tile(quantize_tile(k[:, :, tile], v[:, :, tile],
                                                       v_levels=2**v_bits - 1))  # fmt: skip
        torch.testing.assert_close(k_read[:, :, tile], k_want.float())
        torch.testing.assert_close(v_read[:, :, tile], v_want.float())
        # the filling tile is kept as it was
        assert torch.equal(k_read[:, :, 2 * TILE_TOKENS :], k[:, :, 2 * TILE_TOKENS :])
    # more value bits, a closer value
    errors = [(stored(k, v, bits)[1] - v).abs().mean() for bits in (2, 3, 4)]
    assert errors[0] > errors[1] > errors[2]


def test_a_query_reads_past_the_sink_and_before_its_recent_tiles_from_the_store() -> None:
    reads = quantized_reads(3 * TILE_TOKENS, recent_tiles=1)
    last = 3 * TILE_TOKENS - 1  # in tile 2: reads tile 1 stored, the sink and tile 2 not
    assert reads[last, TILE_TOKENS : 2 * TILE_TOKENS].all()
    assert not reads[last, :TILE_TOKENS].any() and not reads[last, 2 * TILE_TOKENS :].any()
    assert not reads[2 * TILE_TOKENS - 1].any()  # tile 1's own queries read it in 16 bits
    assert not quantized_reads(3 * TILE_TOKENS, recent_tiles=2)[last].any()


@pytest.mark.parametrize(
    ("text", "cache"),
    [("exact", Cache("exact")), ("fp8-fa3", Cache("fp8-fa3")),
     ("kvarn:v_bits=3,recent=4", Cache("kvarn", v_bits=3, recent_tiles=4))],
)  # fmt: skip
def test_cache_names_parse(text, cache) -> None:
    assert Cache.parse(text) == cache


@pytest.mark.parametrize("text", ["int4", "fp8:v_bits=3", "kvarn:bits=3", "kvarn:v_bits=0",
                                  "kvarn:recent=0", "kvarn:v_bits=three"])  # fmt: skip
def test_other_cache_names_are_refused_by_name(text) -> None:
    with pytest.raises(ValueError, match="cache"):
        Cache.parse(text)


def byte_ids(text: str) -> list[int]:
    """A tokenizer of one id a UTF-8 byte: the code text's files are ~100k bytes each."""
    return list(text.encode())


def test_the_code_text_is_stdlib_files_in_a_fixed_order_each_named() -> None:
    ids, facts = tokenize_code(byte_ids, 150_000)  # argparse.py (~100 kB) and part of the next
    assert len(ids) == facts["tokens"] == 150_000
    assert ids[:20] == byte_ids("# file: argparse.py\n")
    assert list(facts["files"]) == ["argparse.py", "inspect.py"]
    assert facts["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    assert (ids, facts) == tokenize_code(byte_ids, 150_000)
    assert tokenize_code(byte_ids, 1000)[0] == ids[:1000]
    with pytest.raises(ValueError, match="fewer than"):
        tokenize_code(byte_ids, 10**7)


def test_an_unknown_text_is_refused_before_the_model_loads(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--text", "bogus", "--out", "/dev/null"])
    assert exit_.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
