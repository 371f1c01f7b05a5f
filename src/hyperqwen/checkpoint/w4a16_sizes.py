"""The W4A16 format's sizes and target names without torch (w4a16.py has the format itself):
what the launcher's capacity count, the kernel benchmarks and the step map need, importable
where loading torch and compressed-tensors would cost a command its start-up time."""

import re

GROUP_SIZE = 128  # input features per symmetric scale group
NUM_BITS = 4  # the base's body linears
SCALE_BYTES = 2  # one bfloat16 scale per group (w4a16.SCALE_DTYPE)
SHAPE_BYTES = 2 * 8  # `weight_shape`: the unpacked (out, in) as int64
REGEX_PREFIX = "re:"


def matches(pattern: str, module: str) -> bool:
    """Whether a `targets`/`ignore` entry names `module`: equal, or `re:` + a regex matched from
    the start (how compressed-tensors and vLLM both read them)."""
    if pattern.startswith(REGEX_PREFIX):
        return re.match(pattern.removeprefix(REGEX_PREFIX), module) is not None
    return pattern == module


def packed_bits(packed_columns: int, in_features: int) -> int:
    """The bit width of packed weights from the shapes alone: `weight_packed` holds 32 / bits
    values per int32 column."""
    return 32 * packed_columns // in_features
