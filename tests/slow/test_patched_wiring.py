"""The PATCHED worker modules of real releases import on CPU, and the hook is live.

Per (release, worker file): the patched module imports with only GPU packages stubbed; the hook
is the first statement of the entry method; it calls the ``dynspec_fallback`` module the patch
installed in that tree; calling the real entry reaches it with (worker, batch) and returns what
it returns; ``ServerArgs`` gained the field (default None) and the CLI flag.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_hook_is_first_statement_of_entry(case, drive):
    release, variant = case
    wiring = drive(release, variant)["wiring"]
    expected_entry = (
        "forward_batch_speculative_generation" if release.version.startswith("0.4.")
        else "forward_batch_generation"
    )
    assert wiring["entry"] == expected_entry
    first, second = wiring["first_statements"]
    assert first.startswith(f"_dynspec_out = dynspec_fallback.maybe_fallback_{variant}(self, ")
    assert second == "if _dynspec_out is not None:\n    return _dynspec_out"


def test_hook_calls_the_installed_runtime(case, drive):
    release, variant = case
    wiring = drive(release, variant)["wiring"]
    assert wiring["fallback_is_installed_module"]
    tree = wiring["worker_module_file"].rsplit("/srt/speculative/", 1)[0]
    assert wiring["fallback_module_file"] == f"{tree}/srt/speculative/dynspec_fallback.py"
    assert wiring["hook_calls"] == 1
    assert wiring["hook_got_worker_and_batch"]
    assert wiring["entry_returned_hook_value"]


def test_server_args_field_and_flag(case, drive):
    release, variant = case
    wiring = drive(release, variant)["wiring"]
    assert wiring["server_args_field_default"] == "None"
    assert wiring["cli_flag_value"] == 6


def test_cpu_reference_kernels_replaced_the_gpu_ones(driven_case, drive):
    release, variant = driven_case
    placements = drive(release, variant)["wiring"]["kernel_placements"]
    # The kernels a one-node verify reaches must have been found and swapped in, or the run
    # would have called a stand-in (which raises) or a Triton kernel (no CPU driver).
    # (0.4.6.post5's fast_topk is SGLang's own torch code, so nothing replaces it there.)
    assert placements.get("assign_req_to_token_pool"), placements
    assert placements.get("create_extend_after_decode_spec_info") or placements.get(
        "create_extend_spec_info"), placements


def test_live_names_of_the_real_modules_are_the_static_probe_s(any_v2_case, drive):
    # The installed runtime, introspecting the real imported modules, picks the same spelling
    # for every module-level need as the static probe of the same release does.
    release, variant = any_v2_case
    from dynspec_patch.patcher.releases import find_pin, release_dir
    from dynspec_patch.transforms.runtime_probe import resolve_static

    live = drive(release, variant)["wiring"]["live_names"]
    assert live["missing"] == []
    root = release_dir(find_pin(release.version))
    static = resolve_static(
        lambda rel: (root / rel).read_text() if (root / rel).is_file() else None, "v2"
    )
    assert live["names"] == {k: static[k] for k in live["names"]}
