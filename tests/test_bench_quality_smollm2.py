"""`hyperqwen bench smollm2`: the converted folder is the GGUF model, on the CPU (~30 s)."""

from __future__ import annotations

import json
import math

import pytest
from cli_runner import run_in_process

from hyperqwen.bench import smollm2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_converted_folder_gives_the_gguf_logits(tmp_path, capsys) -> None:
    try:
        gguf = smollm2.smollm2_gguf()
    except smollm2.Smollm2Missing as missing:
        pytest.skip(str(missing))
    out = tmp_path / "smollm2"
    assert run_in_process("bench", "smollm2", str(out)) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # else vLLM would look for a GGUF quantizer
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    reference, gguf_tokenizer = smollm2.load_gguf_model(gguf)
    converted = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "def add(a, b):\n    return a + b"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == gguf_tokenizer(text, return_tensors="pt").input_ids.tolist()
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    with torch.no_grad():
        expected = reference(ids).logits
        got = converted(ids).logits
    assert torch.equal(expected, got)
    # A real language model: it predicts this code well (a broken conversion would not).
    loss = torch.nn.functional.cross_entropy(got[0, :-1], ids[0, 1:])
    assert math.exp(loss.item()) < 20

    assert run_in_process("bench", "smollm2", str(out)) == 2  # never overwrites
    assert "not empty" in capsys.readouterr().err
