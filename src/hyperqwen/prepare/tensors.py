"""Steps 1-3: lm_head, embed_tokens and the MTP linears to int8 (or int4) group-128, streamed.

The plan is a pure function of the base and the options: which shards change, the name and
tensor layout of each new shard, the new config.json and index. Names are derived from the
content (`model-00002-of-00004.hq-<digest>.safetensors`), so re-running after a crash finds
the shards already written and skips them, and every run produces the same bytes.

Execution streams: a new shard's header is known from the plan, unchanged tensors are copied
byte for byte from the base shard, and each quantized tensor is read, packed and written a
block of rows at a time (group quantization is per row), so memory holds one block, not a
tensor. Each quantized module's round-trip error (the stored int weights dequantized, against
the bf16 original) is measured on the way and kept in `.hyperqwen/measurements/<shard>.json`,
written before the shard itself, so a shard that exists always has its measurements.

Commit order: new shards, then config.json, then the index, which is the commit point (loaders
find tensors through it); base shards nothing refers to any more then move to the pristine
folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from hyperqwen.checkpoint import layout, shards, w4a16
from hyperqwen.checkpoint.geometry import Geometry
from hyperqwen.checkpoint.layout import DECODER_PREFIX, MTP_PREFIX, Kind
from hyperqwen.prepare import folder
from hyperqwen.prepare.marker import Options
from hyperqwen.prepare.validate import Base

# Bump when the bytes prepare writes for the same inputs change: new shard names follow.
FORMAT_REVISION = 1
INT8 = 8
# Source rows read per block: about 8 MiB of bf16, under 100 MiB with quantization's
# float32 temporaries, whatever the tensor size.
BLOCK_BYTES = 8 * 2**20
SHARD_TAG = ".hq-"


@dataclass(frozen=True)
class QuantStep:
    name: str
    group: str
    targets: tuple[str, ...]  # quantization_config targets
    modules: tuple[str, ...]  # the modules those targets name, as the checkpoint names them


# vLLM matches a layer against the targets by name or regex first, then by class ("Linear",
# which group_0 targets), and only then as the parts of a fused layer. So the MTP group must name
# vLLM's fused modules (qkv_proj, gate_up_proj) itself, or the base's int4 group wins them.
MTP_TARGET = (
    rf"re:^{MTP_PREFIX}\.(fc|layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj"
    r"|mlp\.(gate|up|down|gate_up)_proj))$"
)


def quant_steps(geometry: Geometry) -> dict[str, QuantStep]:
    """The three tensor steps. lm_head and embed_tokens are targeted by regex so both the main
    model (`language_model.lm_head`, `language_model.model.embed_tokens` in vLLM) and the MTP
    draft model (`lm_head`, `mtp.embed_tokens`) match; the MTP linears by MTP_TARGET."""
    mtp_linears = tuple(
        spec.module
        for spec in layout.checkpoint_layout(geometry)
        if spec.kind is Kind.LINEAR and spec.name.startswith(f"{MTP_PREFIX}.")
    )
    return {
        "lm_head": QuantStep("lm_head", "hyperqwen_lm_head", ("re:.*lm_head$",), ("lm_head",)),
        "embed": QuantStep(
            "embed",
            "hyperqwen_embed_tokens",
            ("re:.*embed_tokens$",),
            (f"{DECODER_PREFIX}.embed_tokens",),
        ),
        "mtp": QuantStep("mtp", "hyperqwen_mtp", (MTP_TARGET,), mtp_linears),
    }


@dataclass(frozen=True)
class Output:
    """One tensor of a new shard: copied from the base, or one stored part of a quantized module."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: str  # the base tensor it comes from
    part: str | None = None  # weight_packed / weight_scale / weight_shape, or None for a copy


@dataclass(frozen=True)
class ShardJob:
    source: str
    target: str
    outputs: tuple[Output, ...]  # in file order
    bits: dict[str, int]  # quantized module -> bits


@dataclass
class TensorPlan:
    config_text: str
    index_text: str
    weight_map: dict[str, str]
    jobs: list[ShardJob]
    step_of: dict[str, str]  # quantized module -> step name
    max_error: float


def step_bits(options: Options) -> dict[str, int]:
    """The tensor steps `options` do, with their bit widths: int8 heads, MTP at mtp_bits."""
    return {
        step: options.mtp_bits if step == "mtp" else INT8
        for step in ("lm_head", "embed", "mtp")
        if step in options.steps
    }


def _module_of(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


def _shard_job(base: Base, shard: str, bits: dict[str, int]) -> ShardJob | None:
    header = base.headers[shard]
    in_shard = {
        _module_of(name): bits[_module_of(name)]
        for name in header.tensors
        if name.endswith(".weight") and _module_of(name) in bits
    }
    if not in_shard:
        return None
    outputs = []
    for name, entry in header.tensors.items():
        module = _module_of(name)
        if module not in in_shard:
            outputs.append(Output(name, entry.dtype, entry.shape, name))
            continue
        stored = w4a16.stored_shapes(*entry.shape, num_bits=in_shard[module])
        for part, (shape, dtype) in stored.items():
            outputs.append(Output(f"{module}.{part}", shards.dtype_name(dtype), shape, name, part))
    # Widest dtypes first, as safetensors orders them: every tensor starts aligned to its size.
    outputs.sort(key=lambda output: -shards.DTYPE_SIZES[output.dtype])
    digest = hashlib.sha256(
        json.dumps([FORMAT_REVISION, shard, sorted(in_shard.items())]).encode()
    ).hexdigest()[:10]
    stem = shard.removesuffix(".safetensors")
    return ShardJob(shard, f"{stem}{SHARD_TAG}{digest}.safetensors", tuple(outputs), in_shard)


def _all_modules(tensor_names: Iterable[str]) -> list[str]:
    names = {name.rpartition(".")[0] for name in tensor_names}
    return sorted(names | set(layout.vision_linear_modules()))


def prepared_quantization(
    quantization: dict, geometry: Geometry, step_bits: dict[str, int], tensor_names: Iterable[str]
) -> dict:
    """config.json's `quantization_config` after the tensor steps in `step_bits` (step name ->
    bits), for a checkpoint of `geometry` holding `tensor_names`."""
    steps = quant_steps(geometry)
    all_modules = _all_modules(tensor_names)
    for name in ("lm_head", "embed", "mtp"):  # fixed order: the same config for the same steps
        if name in step_bits and steps[name].modules:  # a model without MTP gets no MTP group
            step = steps[name]
            quantization = w4a16.with_int_group(
                quantization,
                step.group,
                step_bits[name],
                list(step.targets),
                step.modules,
                all_modules,
            )
    return quantization


def plan(base: Base, step_bits: dict[str, int], max_error: float) -> TensorPlan:
    """The new files for the tensor steps in `step_bits` (step name -> bits); an empty dict
    plans the base itself."""
    steps = quant_steps(base.geometry)
    bits = {module: step_bits[name] for name in step_bits for module in steps[name].modules}
    jobs = [
        job for shard in sorted(base.headers) if (job := _shard_job(base, shard, bits)) is not None
    ]
    if not jobs:
        return TensorPlan(base.config_text, base.index_text, base.weight_map, [], {}, max_error)
    replaced = {job.source: job for job in jobs}
    weight_map = {}
    total_size = 0
    for shard, header in base.headers.items():
        job = replaced.get(shard)
        entries = (
            [(output.name, output.dtype, output.shape) for output in job.outputs]
            if job
            else [(name, entry.dtype, entry.shape) for name, entry in header.tensors.items()]
        )
        for name, dtype, shape in entries:
            weight_map[name] = job.target if job else shard
            total_size += math.prod(shape) * shards.DTYPE_SIZES[dtype]
    quantization = prepared_quantization(
        base.config["quantization_config"], base.geometry, step_bits, base.weight_map
    )
    config = {**base.config, "quantization_config": quantization}
    return TensorPlan(
        config_text=json.dumps(config, indent=2) + "\n",
        index_text=shards.index_text(weight_map, {**base.index_metadata, "total_size": total_size}),
        weight_map=weight_map,
        jobs=jobs,
        step_of={module: name for name in step_bits for module in steps[name].modules},
        max_error=max_error,
    )


@dataclass
class Measured:
    """Per quantized module: bits and round-trip errors; per step: seconds spent this run and
    whether it wrote anything (a resumed run finds some shards already written)."""

    modules: dict[str, dict] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    written: set[str] = field(default_factory=set)


def _measurements_path(model_dir: Path, target: str) -> Path:
    return model_dir / folder.MEASUREMENTS_DIR / f"{target}.json"


class ErrorMeter:
    """The round-trip error of one tensor fed block by block: ||restored - original|| /
    ||original|| over the whole tensor, and the largest absolute difference."""

    def __init__(self) -> None:
        self.squared_error = 0.0
        self.squared_norm = 0.0
        self.max_abs_error = 0.0

    def add(self, original, restored) -> None:
        # Float64 sums: a float32 dot product over millions of elements drifts by ~1e-3
        # relative, more than the recorded digits. prepare feeds blocks of BLOCK_BYTES, so its
        # float64 temporaries stay small.
        difference = restored.double().sub_(original.double()).flatten()
        self.squared_error += float(difference.dot(difference))
        reference = original.double().flatten()
        self.squared_norm += float(reference.dot(reference))
        self.max_abs_error = max(self.max_abs_error, float(difference.abs_().max()))

    def result(self, bits: int) -> dict:
        relative = math.sqrt(self.squared_error / self.squared_norm) if self.squared_norm else 0.0
        # Rounded so the recorded numbers are stable text, whatever the float noise.
        return {
            "bits": bits,
            "group_size": w4a16.GROUP_SIZE,
            "relative_error": round(relative, 6),
            "max_abs_error": round(self.max_abs_error, 6),
        }


def _write_job(
    job: ShardJob,
    base: Base,
    writer: shards.StreamingShard,
    progress: Callable[[int], None],
    seconds: dict[str, float],
) -> dict[str, dict]:
    """Stream one new shard's tensors in plan order; returns each module's measurements and
    adds the seconds spent quantizing it to `seconds`."""
    source_path = base.shard_path(job.source)
    source_header = base.headers[job.source]
    held_scales: dict[str, list] = {}
    results = {}
    for output in job.outputs:
        entry = source_header.tensors[output.source]
        if output.part is None:
            shards.copy_bytes(source_path, entry.begin, entry.end, writer.write)
            progress(entry.nbytes)
            continue
        module = _module_of(output.source)
        out_features, in_features = entry.shape
        if output.part == "weight_shape":
            writer.write(shards.tensor_view(torch.tensor([out_features, in_features])))
        elif output.part == "weight_scale":
            for block in held_scales.pop(module):
                writer.write(shards.tensor_view(block))
        else:
            started = time.monotonic()
            meter = ErrorMeter()
            held_scales[module] = []
            rows = max(1, BLOCK_BYTES // (2 * in_features))
            for start in range(0, out_features, rows):
                original = shards.read_rows(source_path, entry, start, start + rows)
                stored = w4a16.pack(original, num_bits=job.bits[module])
                meter.add(original, w4a16.unpack(stored))
                writer.write(shards.tensor_view(stored["weight_packed"]))
                held_scales[module].append(stored["weight_scale"])
                progress(original.numel() * original.element_size())
            results[module] = meter.result(job.bits[module])
            seconds[module] = time.monotonic() - started
    writer.finish()
    return results


def error_bound(max_error: float, bits: int) -> float:
    """The bound for `bits`-bit weights: `max_error` is the int8 one; fewer levels per group
    make each step, and so the expected error, larger by the ratio of the level counts."""
    return max_error * (2**INT8 - 1) / (2**bits - 1)


def _check_bound(results: dict[str, dict], max_error: float, where: Path) -> None:
    for module, result in results.items():
        bound = error_bound(max_error, result["bits"])
        if result["relative_error"] > bound:
            raise folder.Refused(
                f"{module}: int{result['bits']} round-trip error "
                f"{result['relative_error']:.3%} exceeds the bound {bound:.3%} "
                f"(--max-error; measured while writing {where.name}). These weights do not "
                "quantize as expected: check the base, or raise --max-error knowingly"
            )


def execute(base: Base, tensor_plan: TensorPlan, progress: bool = True) -> Measured:
    """Write the plan's shards (skipping those already there), restore base shards the plan
    needs back into the folder, then config.json and the index (the commit point), then retire
    shards nothing refers to."""
    model_dir = base.directory
    measured = Measured()
    pending = [job for job in tensor_plan.jobs if not (model_dir / job.target).is_file()]
    total = sum(base.headers[job.source].path.stat().st_size for job in pending)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="shards", disable=not progress or not total
    ) as bar:
        for job in tensor_plan.jobs:
            target = model_dir / job.target
            measurements = _measurements_path(model_dir, job.target)
            if target.is_file() and measurements.is_file():
                results = json.loads(measurements.read_text())
                _check_bound(results, tensor_plan.max_error, target)
            else:
                tensor_layout = [(out.name, out.dtype, out.shape) for out in job.outputs]
                with shards.atomic_file(target) as temporary, temporary.open("wb") as handle:
                    writer = shards.StreamingShard(handle, tensor_layout, {"format": "pt"})
                    seconds: dict[str, float] = {}
                    results = _write_job(job, base, writer, bar.update, seconds)
                    _check_bound(results, tensor_plan.max_error, target)
                    measurements.parent.mkdir(parents=True, exist_ok=True)
                    folder.write_text(
                        measurements,
                        json.dumps(results, indent=2, sort_keys=True) + "\n",
                        f"measurements:{job.target}",
                    )
                folder.write_point(f"shard:{job.target}")
                for module, spent in seconds.items():
                    measured.seconds[tensor_plan.step_of[module]] += spent
                    measured.written.add(tensor_plan.step_of[module])
            measured.modules.update(results)
    live = set(tensor_plan.weight_map.values())
    for shard in sorted(live):
        backup = folder.pristine_path(model_dir, shard)
        if not (model_dir / shard).exists() and backup.exists():
            folder.move(backup, model_dir / shard, f"restore:{shard}")
    folder.replace_base_file(model_dir, folder.CONFIG_NAME, tensor_plan.config_text, "config")
    folder.replace_base_file(model_dir, shards.INDEX_NAME, tensor_plan.index_text, "index")
    _retire(base, live)
    return measured


def _retire(base: Base, live: Iterable[str]) -> None:
    """Base shards nothing refers to move to the pristine folder; prepare's own go away."""
    model_dir = base.directory
    live = set(live)
    for path in sorted(model_dir.glob("*.safetensors")):
        if path.name in live or path.name == folder.DRAFT_HEAD_FILE:
            continue
        if path.name in base.headers and not folder.pristine_path(model_dir, path.name).exists():
            folder.move(path, folder.pristine_path(model_dir, path.name), f"retire:{path.name}")
        elif SHARD_TAG in path.name:
            folder.remove(path, f"retire:{path.name}")
            _measurements_path(model_dir, path.name).unlink(missing_ok=True)
