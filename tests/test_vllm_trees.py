"""copy_vllm_tree shares only what nobody writes: editing the copy leaves the source as is."""

import os
from pathlib import Path

from vllm_trees import copy_vllm_tree


def test_a_copy_links_binaries_and_copies_sources(tmp_path: Path):
    source = tmp_path / "source" / "vllm"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "layer.py").write_text("X = 1\n")
    (source / "_C.abi3.so").write_bytes(os.urandom(64))
    copy = copy_vllm_tree(source, tmp_path / "copy" / "vllm")
    assert (copy / "_C.abi3.so").stat().st_ino == (source / "_C.abi3.so").stat().st_ino
    assert (copy / "sub" / "layer.py").stat().st_ino != (source / "sub" / "layer.py").stat().st_ino
    (copy / "sub" / "layer.py").write_text("X = 2\n")
    assert (source / "sub" / "layer.py").read_text() == "X = 1\n"


def test_the_suite_removes_a_passed_tests_tmp_path(pytestconfig):
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"
