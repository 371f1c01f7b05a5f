"""Every KVarN kernel fits the shared memory of an sm86/sm89 card (RTX 3090/4090: 99 KB per block),
compiled here for sm86 at the 27B's shapes by `python -m hyperqwen.kvarn.fit` (no GPU needed),
those that read or write value codes also for 3-bit values (NAME_v3). The store and dequantize
kernels needed 129 KB when they rotated a whole tile with one dot; a kernel that outgrows the
limit fails to launch on those cards, which this catches first. The same compile checks that the
store kernel's PTX divides and takes roots correctly rounded.

The command runs in its own Python: the test session sets TRITON_INTERPRET=1 (conftest), under
which Triton interprets kernels instead of compiling them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hyperqwen.kvarn.fit import KERNELS, SHARED_LIMIT


def test_every_kernel_fits_99_kb_of_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "hyperqwen.kvarn.fit", "--json", "86"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout)["86"]
    sizes = {name: sm86["shared"] for name, sm86 in compiled.items()}
    assert set(sizes) == set(KERNELS)
    too_big = {name: size for name, size in sizes.items() if size > SHARED_LIMIT[86]}
    assert not too_big, f"over sm86's {SHARED_LIMIT[86]} bytes: {too_big}"
    # read from the compiled kernels: those with dots stage their operands in shared memory
    # (side_write, a copy, has none)
    assert min(sizes["decode_partition"], sizes["prefill"], sizes["store"]) > 0, sizes
    assert sizes["side_write"] == 0
    # the store's fp32 rounds as the interpreter's does (store.py): no approximate / or sqrt,
    # for 3-bit values too
    for store in ("store", "store_v3"):
        assert compiled[store]["approximate_math"] == 0, compiled[store]


def test_the_command_refuses_to_run_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "hyperqwen.kvarn.fit", "86"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unset TRITON_INTERPRET" in done.stderr
