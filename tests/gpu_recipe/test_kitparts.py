"""kitparts.py's packing: the carried files split into parts that each travel in one device
run beside the checkout (a run carries 64 MiB in all, checkout included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "kit"))

import kitparts


def test_files_stay_in_the_part_they_prefer_where_it_has_room():
    items = [("sglang.whl", "A", 10), ("x.whl", "A", 10), ("y.whl", "B", 10)]
    assert kitparts.pack_parts(items, 30) == {"sglang.whl": "A", "x.whl": "A", "y.whl": "B"}


def test_a_full_part_hands_its_last_files_on_to_the_next_letter():
    items = [("sglang.whl", "A", 20), ("a1.whl", "A", 15), ("a2.whl", "A", 15),
             ("b1.whl", "B", 25)]
    assert kitparts.pack_parts(items, 30) == {
        "sglang.whl": "A", "a1.whl": "B", "a2.whl": "B", "b1.whl": "C"}


def test_a_file_handed_on_moves_back_into_an_earlier_part_with_room():
    items = [("sglang.whl", "A", 10), ("big.whl", "B", 25), ("small.whl", "B", 5)]
    assert kitparts.pack_parts(items, 28) == {
        "sglang.whl": "A", "big.whl": "B", "small.whl": "A"}


def test_the_release_wheel_goes_in_part_a_which_is_installed_first():
    assert kitparts.pack_parts([("sglang.whl", "B", 5), ("x.whl", "A", 5)], 30) == {
        "sglang.whl": "A", "x.whl": "A"}


def test_a_file_larger_than_a_part_is_named():
    with pytest.raises(ValueError, match=r"big\.whl alone \(40\.0 MiB\) exceeds"):
        kitparts.pack_parts([("sglang.whl", "A", 1), ("big.whl", "B", 40 * kitparts.MIB)],
                            30 * kitparts.MIB)


def test_a_part_holds_what_one_run_carries_beside_the_checkout(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")  # 9 bytes
    (tmp_path / "tracked.py").write_bytes(b"x" * 100)
    git("add", ".gitignore", "tracked.py")
    (tmp_path / "new.py").write_bytes(b"y" * 50)  # untracked, not ignored: it travels
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "part.whl").write_bytes(b"z" * 1000)  # a carried path, not counted
    assert kitparts.checkout_bytes(tmp_path / "ignored") == 159
    assert kitparts.carry_limit(10 * kitparts.MIB) == 52 * kitparts.MIB
