"""Static probe of the runtime's names against every pinned SGLang release (no import)."""

from collections.abc import Callable
from pathlib import Path

import pytest

from dynspec_patch.patcher.engine import version_key
from dynspec_patch.patcher.releases import Pin, find_pin, load_pins, release_dir
from dynspec_patch.transforms.runtime_probe import probe_release

PATCHABLE = [pin for pin in load_pins() if pin.route == "patch"]


def reader(root: Path, edit: Callable[[str, str], str] | None = None):
    def read(relpath: str) -> str | None:
        path = root / relpath
        if not path.is_file():
            return None
        text = path.read_text()
        return edit(relpath, text) if edit else text

    return read


@pytest.mark.parametrize("pin", PATCHABLE, ids=lambda p: p.version)
def test_every_name_found_for_patched_workers(pin: Pin) -> None:
    report = probe_release(reader(release_dir(pin)), variants=pin.workers)
    missing = [c for c in report.checks if not c.found]
    assert report.ok, missing
    for variant in pin.workers:
        assert f"{variant}[entry=" in report.era
    # 0.5.14+ also have SGLang's own steps-0 path (the native route).
    assert report.native == (version_key(pin.version) >= version_key("0.5.14"))


@pytest.mark.parametrize(
    ("version", "variant"),
    [(pin.version, v) for pin in PATCHABLE for v in pin.refused],
)
def test_refused_worker_variants_are_reported_missing(version: str, variant: str) -> None:
    report = probe_release(reader(release_dir(find_pin(version))), variants=(variant,))
    assert not report.ok


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        (
            "0.4.6.post5",
            [
                "entry=forward_batch_speculative_generation",
                "target_kwarg=skip_sample",
                "graph_attr=cuda_graph_runner",
                "root_field=verified_id",
            ],
        ),
        (
            "0.5.10.post1",
            [
                "entry=forward_batch_generation",
                "vo_next_input=draft_input",
                "target_kwarg=is_verify",
                "graph_attr=graph_runner",
            ],
        ),
        (
            "0.5.12.post1",
            [
                "vo_next_input=draft_extend_input",
                "root_field=bonus_tokens",
                "gbr_stride=speculative_num_draft_tokens",
            ],
        ),
        ("0.5.13.post1", ["v1[absent]", "gbr_new_seq_lens=new_seq_lens"]),
        ("0.5.5.post2", ["gbr_allocate_lens=allocate_lens"]),
        (
            "0.5.17",
            [
                "v1[absent]",
                "graph_attr=decode_cuda_graph_runner",
                "sample_fn=eagle_sample",
                "logprob_fn=compute_spec_v2_logprobs",
            ],
        ),
        ("0.5.23", ["sample_fn=eagle_sample", "logprob_fn=compute_spec_logprobs"]),
    ],
)
def test_era_names_the_adapter_choices(version: str, expected: list[str]) -> None:
    report = probe_release(reader(release_dir(find_pin(version))))
    for fragment in expected:
        assert fragment in report.era


def test_renamed_field_is_not_found() -> None:
    root = release_dir(find_pin("0.5.10.post1"))

    def rename(relpath: str, text: str) -> str:
        if relpath == "srt/speculative/eagle_info.py":
            old, new = "    retrive_next_sibling: torch.Tensor", "    next_sib: torch.Tensor"
            return text.replace(old, new)
        return text

    report = probe_release(reader(root, rename), variants=("v1",))
    assert not report.ok
    failed = [c for c in report.checks if not c.found]
    assert any("retrive_next_sibling" in c.name for c in failed)
    assert any(c.file == "srt/speculative/eagle_info.py" for c in failed)
    # A new required field nobody fills is caught as well.
    assert any("required fields" in c.name and "next_sib" in c.detail for c in failed)


def test_removed_worker_method_is_not_found() -> None:
    root = release_dir(find_pin("0.5.12.post1"))

    def drop(relpath: str, text: str) -> str:
        if relpath == "srt/speculative/eagle_worker.py":
            return text.replace("def _draft_preprocess_idle(", "def _renamed_idle(")
        return text

    report = probe_release(reader(root, drop), variants=("v1",))
    failed = [c.name for c in report.checks if not c.found]
    assert failed == ["v1 worker _draft_preprocess_idle"]


def test_too_old_release_is_not_ok() -> None:
    report = probe_release(reader(release_dir(find_pin("0.4.3.post4"))))
    failed = {c.name for c in report.checks if not c.found}
    assert "v1 param EagleVerifyInput.prepare_for_verify.page_size" in failed


@pytest.mark.parametrize("version", ["0.5.16", "0.5.23"])
def test_native_releases_are_flagged(version: str) -> None:
    report = probe_release(reader(release_dir(find_pin(version))))
    assert report.native
    assert "v1[absent]" in report.era


def test_empty_tree_is_not_ok_and_serialises() -> None:
    report = probe_release(lambda _relpath: None)
    assert not report.ok
    data = report.to_json()
    assert data == {"era": "v1[absent]; v2[absent]", "ok": False, "native": False, "checks": []}


def test_probe_directory_reads_an_unpacked_tree() -> None:
    from dynspec_patch.transforms.runtime_probe import probe_directory

    root = release_dir(find_pin("0.5.13.post1"))
    assert probe_directory(root).ok
    assert not probe_directory(root.parent).ok  # not the sglang package dir itself


SYNTHETIC_WORKER = """
from typing import TYPE_CHECKING
from .info import EagleVerifyInput
from sglang.srt.speculative.info import EagleDraftInput
if TYPE_CHECKING:
    from sglang.srt.speculative.other import EagleDraftInput

class EAGLEWorker:
    def forward_batch_generation(self, batch):
        return None
"""
SYNTHETIC_INFO = """
from dataclasses import dataclass
from sglang.srt.speculative.other import EagleDraftInput  # shadowed by the class below

@dataclass
class Base:
    draft_token: object
    kv_loc_plan: object

@dataclass
class EagleVerifyInput(Base):
    custom_mask: object = None

@dataclass
class EagleDraftInput:
    bonus_tokens: object = None
"""


def test_fields_come_from_dataclass_bases_and_type_checking_imports_are_ignored() -> None:
    files = {
        "srt/speculative/eagle_worker.py": SYNTHETIC_WORKER,
        "srt/speculative/info.py": SYNTHETIC_INFO,
        "srt/speculative/other.py": "class EagleDraftInput:\n    verified_id: int = 0\n",
    }
    report = probe_release(files.get, variants=("v1",))
    by_name = {c.name: c for c in report.checks}
    # Inherited from the dataclass base, through a relative import.
    assert by_name["v1 fields EagleVerifyInput.draft_token"].found
    assert by_name["v1 fields EagleVerifyInput.draft_token"].file == "srt/speculative/info.py"
    required = by_name["v1 EagleVerifyInput required fields all filled"]
    assert not required.found and "kv_loc_plan" in required.detail
    # A TYPE_CHECKING import never runs, and a later definition shadows an earlier import.
    assert by_name["v1 fields EagleDraftInput.verified_id|bonus_tokens"].detail == (
        "found bonus_tokens"
    )
