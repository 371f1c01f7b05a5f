"""The step map (bench/stepmap.py) on a cut of a real trace: the served 27B single profile on an
H200 (MTP, 3 drafts; dummy weights), profiled by tests/test_bench_stepmap_gpu.py at 94b2158.

tests/data/stepmap-27b-cut.trace.json.gz holds one decode step of that trace: its GPU step
range and the next one's, its GPU ops and the CUDA calls that launched them (args cut to the
correlation id). Layers 4-63 are cut out of the forward (the ops between layer 3's mlp_down
GEMM and layer 63's, both ends' included, are gone) and the ops after the cut, the range's end
and the next range moved earlier by the time those layers took. What is left is a forward of
the 27B's first block (3 GDN layers, 1 attention layer), its int8 lm_head, then sampling and
the MTP drafter, as the server launched them: Marlin GEMMs, torch.compile's fused Triton
kernels (named after the Marlin GEMM they feed), 7 CUDA graph replays and eager input
preparation.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from hyperqwen.bench import stepmap
from hyperqwen.bench.profile import load_trace
from hyperqwen.checkpoint.geometry import PRESETS

TRACE = Path(__file__).parent / "data" / "stepmap-27b-cut.trace.json.gz"
FACTS = stepmap.ModelFacts(PRESETS["27b"].with_overrides(["num_hidden_layers=4"]), lm_head_bits=8)
MARLIN_PREFIX = "void marlin::Marlin<"


@pytest.fixture(scope="module")
def step():
    steps, left_out = stepmap.segment(load_trace(TRACE))
    assert (len(steps), left_out, steps[0].tokens) == (1, 0, 4)
    return steps[0]


def test_the_forward_gemms_are_the_marlin_kernels_matched_to_the_first_block(step):
    assert FACTS.geometry.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    classes, matched = stepmap.classify(step, FACTS)
    assert matched
    gemms = [
        (name, op.name)
        for op, name in zip(step.ops, classes, strict=True)
        if name == stepmap.LM_HEAD or name.startswith(stepmap.BODY_PREFIX)
    ]
    # in launch order, exactly the geometry's sequence, and each one a Marlin kernel: the fused
    # Triton kernels named ..._marlin_gemm_... are the norms and activations around them
    assert [name.removeprefix(stepmap.BODY_PREFIX) for name, _ in gemms] == FACTS.forward_gemms()
    assert all(kernel.startswith(MARLIN_PREFIX) for _, kernel in gemms)
    fused = [
        name
        for op, name in zip(step.ops, classes, strict=True)
        if "marlin_gemm" in op.name and op.start < step.forward_end
    ]
    assert fused and set(fused) == {"norm_activation"}
    # after the forward: the drafter's 3 drafts, each its MTP layer's 4 GEMMs and the lm_head
    counts = Counter(classes)
    assert counts[stepmap.DRAFTER_GEMMS] == 15 and counts[stepmap.UNMATCHED_GEMMS] == 0


def test_gdn_decode_kernels_are_gdn(step):
    classes, _ = stepmap.classify(step, FACTS)
    gdn = Counter(op.name for op, name in zip(step.ops, classes, strict=True) if name == "gdn")
    # one causal conv1d update and one gated delta rule update per GDN layer
    assert gdn == {
        "_causal_conv1d_update_kernel": 3,
        "fused_sigmoid_gating_delta_rule_update_kernel": 3,
    }


def test_the_window_splits_into_graph_replays_and_the_rest(step):
    replays = Counter(op.graph for op in step.ops if op.graph is not None)
    assert len(replays) == 7  # the forward's graph, then the drafter's six
    classes, _ = stepmap.classify(step, FACTS)
    by_class = {name: op for op, name in zip(step.ops, classes, strict=True)}
    forward_graph = by_class["body_mlp_down"].graph
    assert forward_graph is not None and replays[forward_graph] == max(replays.values())
    assert by_class[stepmap.LM_HEAD].graph is None  # the logits run eagerly, after the graph
    found = stepmap.gaps(step)
    outside_busy = found.busy_us - found.graph_busy_us
    assert 0 < found.graph_busy_us < found.busy_us and outside_busy > 0
    idle = step.end - step.start - found.busy_us
    assert 0 < found.graph_idle_us < found.short_us <= idle
    summary = stepmap.summarize_steps([step], FACTS)
    assert summary["graph_replays_per_step"] == 7
    parts = ("graph_busy_ms", "graph_idle_ms", "outside_graphs_busy_ms", "outside_graphs_idle_ms")
    assert sum(summary[part] for part in parts) == pytest.approx(summary["step_span_ms"], abs=4e-4)
