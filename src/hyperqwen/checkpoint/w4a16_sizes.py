"""The W4A16 format's sizes without torch (w4a16.py has the format itself): what the launcher's
capacity count and the kernel benchmarks need, importable where loading torch would cost a
launch its start-up time."""

GROUP_SIZE = 128  # input features per symmetric scale group
NUM_BITS = 4  # the base's body linears
SCALE_BYTES = 2  # one bfloat16 scale per group (w4a16.SCALE_DTYPE)
SHAPE_BYTES = 2 * 8  # `weight_shape`: the unpacked (out, in) as int64


def packed_bits(packed_columns: int, in_features: int) -> int:
    """The bit width of packed weights from the shapes alone: `weight_packed` holds 32 / bits
    values per int32 column."""
    return 32 * packed_columns // in_features
