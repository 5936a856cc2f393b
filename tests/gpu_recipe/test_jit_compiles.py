"""jit_compiles.py: the kernels a server's JIT caches gained while a level ran."""

from __future__ import annotations

import sys
from pathlib import Path

KIT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "kit"
sys.path.insert(0, str(KIT / "scripts"))

from jit_compiles import JitCompiles  # noqa: E402


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")


def test_the_files_a_level_added_name_their_kernels(tmp_path):
    triton, tvm = tmp_path / "triton", tmp_path / "tvm"
    touch(triton / "aaa" / "old_kernel.json")  # compiled before the level: not counted
    touch(tvm / "old" / "libold.so")
    env = {"TRITON_CACHE_DIR": str(triton), "TVM_FFI_CACHE_DIR": str(tvm)}
    with JitCompiles(env) as jit:
        touch(triton / "bbb" / "assign_req_to_token_pool.json")
        touch(triton / "bbb" / "assign_req_to_token_pool.cubin")
        touch(triton / "bbb" / "__grp__assign_req_to_token_pool.json")  # Triton's group file
        touch(tvm / "new" / "libfused_rope.so")
    assert jit.summary() == {
        "triton": {"new_files": 3, "kernels": ["assign_req_to_token_pool"]},
        "tvm_ffi": {"new_files": 1, "kernels": ["libfused_rope"]},
    }


def test_a_level_that_compiled_nothing_says_so(tmp_path):
    (tmp_path / "triton").mkdir()
    touch(tmp_path / "triton" / "aaa" / "k.json")
    with JitCompiles({"TRITON_CACHE_DIR": str(tmp_path / "triton")}) as jit:
        pass
    assert jit.summary() == {"triton": {"new_files": 0, "kernels": []}}


def test_a_cache_made_during_the_level_counts_from_empty(tmp_path):
    with JitCompiles({"TRITON_CACHE_DIR": str(tmp_path / "triton")}) as jit:
        touch(tmp_path / "triton" / "aaa" / "k.json")
    assert jit.summary() == {"triton": {"new_files": 1, "kernels": ["k"]}}


def test_without_a_cache_directory_nothing_is_recorded(tmp_path):
    with JitCompiles({"TRITON_CACHE_DIR": str(tmp_path / "absent")}) as jit:
        pass
    assert jit.summary() is None
