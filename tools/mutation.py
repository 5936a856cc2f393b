"""Mutation testing of dynspec-patch's safety-critical modules, on demand (not in CI).

    .venv/bin/pip install -e '.[test,mutation]'
    .venv/bin/python tools/mutation.py                  # every module below
    .venv/bin/python tools/mutation.py engine local     # some of them
    .venv/bin/python tools/mutation.py --survivors      # and the diff of each surviving mutant

mutmut 3 makes each mutant of a module, runs the tests that guard that module against it, and
this prints killed / survived / timeout per module. Modules whose tests need sshd or docker run
under the heavy lock (``flock /tmp/dynspec-heavy.lock``), as every such test run on the shared
machine must.

Why a stage directory: the package installs as ``dynspec_patch.*`` from ``patcher/``,
``transforms/`` and ``fixtures/`` (setuptools package-dir), but mutmut names a mutant after its
file's path, and a mutant is only live in a module whose import name is that path. So each module
runs in ``.mutation/<module>/``, a copy of the tree laid out as the package installs
(``dynspec_patch/patcher/engine.py`` …) beside ``tests/`` and ``ansible_collections/``; mutmut
copies it into ``mutants/`` and puts that first on ``sys.path``, ahead of the editable install.
Tests that run the CLI or ansible-playbook in a process of their own get the mutants through
``PYTHONPATH``, and ``tools/mutation_hits/`` tells mutmut which mutated functions those processes
ran, so those tests count for those functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HITS = ROOT / "tools" / "mutation_hits"
HEAVY_LOCK = "/tmp/dynspec-heavy.lock"
# the layout of the installed package: directory in the checkout -> its import path
PACKAGE_DIRS = {"patcher": "dynspec_patch/patcher", "transforms": "dynspec_patch/transforms",
                "fixtures": "dynspec_patch/fixtures"}
PYTEST_ARGS = ["-m", "not slow", "--import-mode=importlib", "-p", "no:cacheprovider",
               "-p", "mutation_hits_plugin"]


@dataclass(frozen=True)
class Target:
    """One module, the tests that guard it, and (optionally) the functions to mutate.

    ``functions`` are mutmut's names without the module: ``x_name`` for a function,
    ``xǁClassǁname`` for a method; an empty tuple mutates every function of the file.
    """

    path: str  # in the staged layout
    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()
    heavy: bool = False  # the tests start sshd or docker: run under the heavy lock
    why: str = ""  # why the tests or the functions are restricted
    # reviewed survivors that change nothing a user can see: (function, a piece of the mutated
    # line as `mutmut show` prints it, why); matched on the text, not mutmut's numbers, which
    # move when the code does
    equivalent: tuple[tuple[str, str, str], ...] = ()
    # run only the mutants whose number ends in one of these digits ("0": a tenth, "05": a
    # fifth), where the guarding tests take minutes each; empty: every mutant
    sample: str = ""

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")

    def patterns(self) -> list[str]:
        last = f"[{self.sample}]" if self.sample else ""
        return [f"{self.module}.{name}__mutmut_*{last}" for name in self.functions or ("*",)]


def _methods(cls: str, *names: str) -> tuple[str, ...]:
    return tuple(f"xǁ{cls}ǁ{name}" for name in names)


RUNTIME = "dynspec_patch/transforms/runtime/dynspec_fallback.py"
CLI_LEVEL = ("the in-process tests on small trees; the tests over real releases "
             "(test_local_safety, test_cli_contract, test_native_and_cli, test_pinned_releases: "
             "10-35 s each on this machine) are left out of the per-mutant runs, they can only "
             "add kills")

TARGETS: dict[str, Target] = {
    "dynspec_fallback": Target(
        RUNTIME, ("tests/runtime",),
        functions=(
            *_methods("DynSpecController", "__init__", "decide", "_switch"),
            "x_effective_batch_size", "x_default_resume_below", "x__decide", "x__is_pure_decode",
            "x__has_grammar", "x_maybe_fallback_v1", "x_maybe_fallback_v2",
            # the auto controller's decisions: goodput by batch size, measured costs, the sync
            "x_parse_threshold", *_methods("CostTable", "step_ms", "deciding_size"),
            *_methods("Snapshot", "to_wire", "from_wire"), "x_padded_batch_size",
            *_methods("GoodputPolicy", "__init__", "adopt", "estimates", "decide",
                      "_wins_needed", "_at_last_switch_load", "_recent_flaps",
                      "_other_mode_wins", "_explores", "_switch"),
            "x__same_load", "x_step_clock",
            *_methods("Measurements", "__init__", "add", "resolve", "_add_acceptance",
                      "snapshot"),
            *_methods("AutoController", "__init__", "decide", "_sync", "start_step",
                      "finish_step"),
            # which speed levers run, and the warm-up's order of graph sizes
            "x_lever_on", "x_replays_with_replay", "x_warmup_order",
        ),
        equivalent=(("x__is_pure_decode", '"is_extend_in_batch", None)',
                     "None and False are both false: a batch without the field is pure decode "
                     "either way"),
                    *(("x_warmup_order", piece, "the key is only compared for equality: "
                       "negating one part, or 257 for the floor 256 (below every larger power "
                       "of two), groups the same sizes together")
                      for piece in ("return bs != 1, bs", "bs % 16 != 0, max(", "max(257, 1")),
                    ("xǁSnapshotǁto_wire", 'float("NAN")', "float() reads nan in any case"),
                    ("xǁGoodputPolicyǁestimates",
                     "plain_ms = self.snapshot.table.step_ms(None, padded)",
                     "step_ms reads None as not speculative, as False"),
                    ("xǁGoodputPolicyǁestimates", "assert spec_ms or plain_ms", "deciding_size "
                     "only returns sizes with both costs: the assertion holds either way")),
        why="the controllers (threshold and auto) and the step decisions: whether a step runs "
            "speculative or the fallback (the fallback steps themselves, _v1_step/_v2_step, "
            "~400 mutants at ~10 s each here, and the adapters are left out; the slow tier runs "
            "them on real SGLang)"),
    "auto_readings": Target(
        RUNTIME, ("tests/runtime",),
        functions=(
            # what auto reads before it decides: acceptance by request, the window, probes,
            # prefill costs and the admission rate, and the rules that use them
            "x_auto_config_overrides", "x_fit_prefill_cost",
            *_methods("PrefillCost", "per_step_ms"),
            *_methods("Snapshot", "prefill_ms_per_step"),
            *_methods("Estimates", "spec_tok_s", "plain_tok_s"),
            *_methods("GoodputPolicy", "_with_prefills", "defer_speculation", "_probe_steps",
                      "_recent_switch", "_acceptance_is_of", "_acceptance_is_enough",
                      "_speculation_cannot_win", "_prefills_read"),
            "x_speculating_tokens_per_step", "x_speculating_tokens", "x__readings_by_request",
            "x__plain_mean", "x__steps_per_token",
            *_methods("Measurements", "add_prefill", "_add_admissions", "admitted_per_token",
                      "_confidence", "_reads_by_request", "_window_reading", "_trim_window",
                      "_set_window", "_probe_window", "_end_stretch", "_newest_is_a_batch",
                      "_publish"),
            *_methods("AutoController", "finish_prefill"),
        ),
        equivalent=(
            *(("x_fit_prefill_cost", piece, "the deviations from a mean sum to 0: adding the "
               "other mean to one factor adds mean * 0 to the sum")
              for piece in ("(n + mean_n) * (ms - mean_ms)", "(n - mean_n) * (ms + mean_ms)")),
            ("x_speculating_tokens_per_step", "speculating_tokens(steps, 1.0)",
             "z moves only the bound; this reads the estimate"),
            ("xǁGoodputPolicyǁ_speculation_cannot_win", "table.step_ms(None, padded)",
             "step_ms reads None as not speculative, as False"),
            *(("xǁGoodputPolicyǁ_speculation_cannot_win", piece, "an estimate's batch_size "
               "and padded are labels: its tok/s come from costs_of")
              for piece in ("_with_prefills(None, padded, most",
                            "_with_prefills(padded, None, most")),
            ("xǁGoodputPolicyǁ_speculation_cannot_win",
             "deciding is not None and deciding <= padded",
             "deciding_size never returns the size asked about: one with both costs is decided "
             "above, by its own"),
            ("xǁGoodputPolicyǁ_with_prefills", "prefill_ms_per_step(None, admitted)",
             "prefill_ms_per_step reads None as not speculative, as False"),
            ("xǁMeasurementsǁ_add_admissions", "while len(window) >= 1 and",
             "with one step left, the tokens less its own are 0, below any admission_tokens "
             "(a positive int)"),
            ("xǁMeasurementsǁ_end_stretch", "self._in_stretch = None",
             "_in_stretch is only read for its truth"),
        ),
        why="auto's readings (added after the dynspec_fallback target's functions were "
            "listed): the same module and tests, other functions"),
    "draft_kv_write": Target(
        RUNTIME,
        ("tests/runtime/test_draft_kv_write.py", "tests/runtime/test_no_host_sync.py",
         "tests/runtime/test_warmup.py", "tests/runtime/test_auto_runtime.py",
         "tests/runtime/test_draft_extend_width1.py"),
        functions=(
            *_methods("DraftKvWrite", "compute", "_compute", "write", "matches"),
            "x_draft_kv_write_for", "x__prepare_draft_kv_write", "x__draft_state_stub",
            "x__v2_draft", "x__check_draft_kv_write", "x_tp_group_of",
            "x_sglang_release", "x_on_gpu_proven_release",
        ),
        equivalent=(
            *(("xǁDraftKvWriteǁ_compute", piece, "the tensors are 2-D (rows, width): dim 1 "
               "and shape[1] are dim -1 and shape[-1]")
              for piece in ("dim=+1", "hidden.shape[+1]", "embeds.shape[+1]")),
            *(("xǁDraftKvWriteǁ_compute", piece, "the hidden state is cut into as many chunks "
               "as there are fc norms: zip pairs them all, strict or not")
              for piece in ("strict=None", "strict=False", "zip(fc_norm, chunks, )")),
            ("x__v2_draft", "draft_state_stale = None", "None and False are both false"),
            *(("x_draft_kv_write_for", piece, "the default is read as a truth value: None and "
               "False are both false")
              for piece in ('"is_mrope_enabled", None)', '"is_quantized_kv_cache", None)',
                            '"use_hnd", None)')),
            ("x_draft_kv_write_for", '"dcp_size", None)', "None or 1 is 1, the default's value"),
            ("x__prepare_draft_kv_write", "'XX, XX'.join(GPU_PROVEN_RELEASES)", "one release: "
             "the separator is never written"),
        ),
        why="the v2 fallback's draft KV write: when it is used, what it computes and stores, "
            "the check against SGLang's draft-extend, the draft state it hands on; and the TP "
            "group every start-up agreement runs over"),
    "batched_kv_write": Target(
        RUNTIME,
        ("tests/runtime/test_draft_kv_write.py", "tests/runtime/test_draft_prefill_write.py"),
        functions=(
            *_methods("DraftKvWrite", "defer", "flush"), "x_draft_kv_write_steps",
            "x_settle_draft_kv",
        ),
        why="the batched draft KV write (DYNSPEC_DRAFT_KV_WRITE_STEPS): which steps keep their "
            "rows, when the kept rows are stored and in which order, and its setting"),
    "draft_prefill_write": Target(
        RUNTIME,
        ("tests/runtime/test_draft_prefill_write.py",),
        functions=(
            *_methods("DraftPrefillWrite", "takes", "placeholder"),
            "x__prepare_draft_prefill_write", "x__prefill_stores_draft_kv_only",
            "x__prefill_with_draft_kv_write", "x__check_draft_prefill_write", "x__run_own_entry",
        ),
        equivalent=(
            ("x__check_draft_prefill_write", '"XX; XX".join', "the draft's forward runs once "
             "per prefill, so one write is checked: the separator is never written"),
            ("xǁDraftPrefillWriteǁplaceholder", "weight.shape[+1]", "the embedding weight is "
             "2-D: shape[1] is shape[-1]"),
            ("x__prepare_draft_prefill_write", "DRAFT_PREFILL_WRITE_ENV, None)", "the default "
             "is read as a truth value: None and False are both false"),
            ("x__run_own_entry", "adapter.reentered = None", "only ever read as a truth value"),
        ),
        why="the prefill's draft pass as K and V only (DYNSPEC_DRAFT_PREFILL_WRITE): which "
            "prefills take it, the first one's check, SGLang's prefill graph set aside for it, "
            "what it hands on"),
    "draft_kv_write_graphs": Target(
        RUNTIME,
        ("tests/runtime/test_draft_kv_write_graphs.py", "tests/runtime/test_warmup.py",
         "tests/runtime/test_fallback_v2.py"),
        functions=(
            *_methods("_WriteGraph", "run"),
            *_methods("DraftKvWrite", "write", "_graph", "_capture"),
            "x__use_draft_kv_write_graphs", "x__event_recorded",
        ),
        equivalent=(
            *(("xǁDraftKvWriteǁ_capture", piece, "on a CPU the default device is the model's")
              for piece in ("device = None", "device=None)", "torch.int64, )")),
            *(("xǁDraftKvWriteǁ_capture", piece, "the static tokens are only copied into and "
               "read through .to(torch.int64): small ints survive float")
              for piece in ("dtype=None, device=device", "zeros(size, device=device)")),
            ("x__event_recorded", "get_device_module(None)", "on a CPU the default device "
             "module is the batch's"),
            ("x__use_draft_kv_write_graphs", '"XXXX").strip() == "0"', "unset and any text "
             "but 0 are both not 0 here (lever_on read it already)"),
            ("x__use_draft_kv_write_graphs", "'XX, XX'.join(DRAFT_KV_WRITE_GRAPH_RELEASES)",
             "one release: the separator is never written"),
            *(("x__use_draft_kv_write_graphs", piece, "a TP group's world_size is never 0: "
               "None or 1 and 1 or 2 are 1")
              for piece in ('"world_size", None)', "or 2) > 1")),
        ),
        why="the draft KV write's CUDA graphs (which size replays, what the padding rows "
            "store, when it stays eager) and the v2 step's early verify_done"),
    "tp_agreement": Target(
        RUNTIME,
        ("tests/runtime/test_decode_graphs.py", "tests/runtime/test_tp_ranks_capture.py",
         "tests/runtime/test_draft_extend_width1.py"),
        functions=("x__prepare_decode_graphs", "x__tp_rank", "x__ranks_in",
                   "x__all_ranks_agree"),
        equivalent=(
            *(("x__all_ranks_agree", piece, "a TP group's world_size is never 0: None or 1 "
               "and 1 or 2 are 1") for piece in ('"world_size", None)', "1) or 2) <= 1")),
            *(("x__all_ranks_agree", piece, "the flag is 0 or 1 (or 2): int64 reduces by MIN "
               "as int32 does, and only its truth is read")
              for piece in ("dtype=None)", "else 0], )", "[2 if ok else 0]")),
            ("x__prepare_decode_graphs", '"XX1XX").strip() == "0"', "unset and any text but "
             "0 are both not 0"),
            ("x__tp_rank", '"tp_rank", None) or 0)', "None or 0 is 0, the "
             "default's value"),
            ("x__ranks_in", '(text or "XXXX")', "neither names a rank: both give no ranks"),
        ),
        why="the TP ranks' agreement on what their start-up captures give: the fallback's "
            "DECODE graphs on every rank or none, the per-rank failure that tests it, the CPU "
            "all-reduce every lever's agreement runs (two real gloo processes)"),
    "step_profiler": Target(
        RUNTIME,
        ("tests/runtime/test_decode_graphs.py", "tests/runtime/test_draft_prefill_write.py",
         "tests/runtime/test_auto_policy.py", "tests/runtime/test_draft_kv_write.py",
         "tests/runtime/test_draft_extend_width1.py", "tests/runtime/test_mutation_fallback.py"),
        functions=(
            *_methods("StepProfiler", "__init__", "start", "start_prefill", "_begin", "mark",
                      "finish", "_resolve_all", "summary", "prefill_summary", "_report"),
            "x__phase_means", "x__make_profiler", "x__profiled_prefill",
            *_methods("GoodputPolicy", "describe", "_counters"),
        ),
        equivalent=(
            ("x__make_profiler", '(PROFILE_ENV, "XXXX")', "unset and XXXX are both not digits: "
             "no profiler either way"),
            *(("xǁStepProfilerǁ__init__", piece, "overwritten by _begin before anything reads "
               "it") for piece in ('self._device: Any = ""', "self._key: int | str = None",
                                   "self._key: int | str = 1")),
            *(("xǁStepProfilerǁ_begin", piece, "the first mark's name is never reported: a "
               "phase is named by the mark that ends it")
              for piece in ("self.mark(None)", 'self.mark("XXstartXX")', 'self.mark("START")')),
            ("xǁStepProfilerǁ_report", '"XX XX".join(f"{p}=', "a prefill has one phase: the "
             "separator of the prefill line is never written"),
            ("xǁStepProfilerǁfinish", "self._steps -= 1", "-k % n == 0 exactly when k % n == 0: "
             "the same steps report"),
        ),
        why="DYNSPEC_PROFILE: the fallback steps' phases, the hook's prefills by mode, auto's "
            "counters with each report (a diagnostic, off by default)"),
    "one_token_verify": Target(
        RUNTIME,
        ("tests/runtime/test_one_token_verify.py", "tests/runtime/test_warmup.py",
         "tests/runtime/test_draft_kv_write_v1.py", "tests/runtime/test_fallback_v1.py"),
        functions=(
            "x_verify_request_attributes", "x__one_token_verify_refusal",
            "x__prepare_one_token_verify", "x__one_token_verify_applies",
            "x__v1_one_token_verify", "x__write_only_stub", "x__v1_draft",
        ),
        equivalent=(
            ("x__prepare_one_token_verify", "'XX, XX'.join(ONE_TOKEN_VERIFY_RELEASES)",
             "one release: the separator is never written"),
            *(("x__v1_one_token_verify", piece, "the requests and the tokens are as many (one "
               "token per request): zip never meets a shorter one")
              for piece in ("strict=None)", "tokens.tolist(), )", "strict=False)")),
            ("x__v1_one_token_verify", "if len(running) <= len(batch.reqs)", "keeping every "
             "row gives the same slots and tokens (copies)"),
            *(("x__v1_one_token_verify", piece, "on a CPU the default device is the tokens'")
              for piece in ("device=None)", "dtype=torch.int64, )")),
            ("x__one_token_verify_applies", '"logit_bias", False) is None', "a default that "
             "is not None fails closed whatever it is"),
            ("x__v1_draft", "draft_state_stale = None", "only ever read as a truth value"),
            ("x__v1_draft", "running, dtype=None,", "a list of ints makes an int64 tensor"),
            ("x__v1_draft", "running, device=tokens.device)", "a list of ints makes an int64 "
             "tensor"),
            *(("x__v1_draft", piece, "on a CPU the default device is the tokens'")
              for piece in ("device=None)", "dtype=torch.int64, )")),
        ),
        why="v1's one-token bookkeeping: where it applies, what it leaves, its refusals"),
    "engine": Target(
        "dynspec_patch/patcher/engine.py",
        ("tests/codemods/test_mutation_engine.py",
         "tests/codemods/test_local_safety.py::"
         "test_an_unknown_file_in_a_tree_without_manifest_makes_the_tree_unknown"),
        equivalent=(
            *((name, '"UTF-8"', "codec names are case-insensitive")
              for name in ("x__encode", "x__text", "x_release_version")),
            *(("x__route", piece, "the kernels' text is searched for a name and a one-line "
               "def: a separator between the two files cannot make or break a match")
              for piece in ('"XXXX".join', 'or "XXXX" for path')),
            ("x__apply_one", "(isinstance(state, Patched)) or True", "a codemod's revert of a "
             "file that is not patched gives back its own bytes (None for a missing file)"),
            ("x__any_patched", 'or b"XXXX")', "the default stands in only for a present file "
             "that is empty, and neither b'' nor b'XXXX' holds the tool's name"),
            *(("x_plan_status", piece, "_route compares the requested route with \"native\" "
               "only: None, \"\" and any other spelling of \"patch\" all take the patch route")
              for piece in ('requested = ""', '"XXpatchXX" if', '"PATCH" if')),
        ),
        why=CLI_LEVEL),
    "local": Target(
        "dynspec_patch/patcher/local.py",
        ("tests/codemods/test_mutation_local.py",
         "tests/remote/test_mutation_remote_agent.py::"
         "test_the_holder_line_is_stamped_in_utc_whatever_the_zone"),
        equivalent=(
            ("x__recover", "(done) or True", "recover_journal returns None only when there is "
             "no journal, which _recover has just checked"),
            *((name, piece, "the undo directory exists here (written by _prepare, or read by "
               "undo a moment before), so there is no error to ignore")
              for name in ("x_write_plan", "x__roll_back")
              for piece in ("ignore_errors=None", '"undo", )', "ignore_errors=False")),
            ("x__prepare", "shutil.rmtree(None, ignore_errors=True)", "no undo directory is "
             "left at this point: the lock's housekeeping and every write_plan end remove it"),
            ("x__atomic_write", "contextlib.suppress(None)", "the temporary file exists "
             "until it is replaced, so unlinking it after a failure cannot miss"),
            *(("x_write_plan", piece, "the target was copied into undo/ a moment before, "
               "under the lock: it cannot be missing here")
              for piece in ("unlink(missing_ok=None)", "unlink(missing_ok=False)")),
            *(("x__stage_all", piece, "every staged file was just written by this process")
              for piece in ("unlink(missing_ok=None)", "unlink(missing_ok=False)")),
            *(("x__stage", piece, "the compiled file is scratch: under any name beside the "
               "staged file it is removed the same way")
              for piece in ('"XX.pycXX"', '".PYC"')),
            *(("x__stage", piece, "dfile names the file only in the traceback's location "
               "line; the refusal keeps the error's last line")
              for piece in ("dfile=None", "dfile=str(None)", "cfile=str(compiled), doraise")),
            *(("x_write_native_config", piece, "the state directory's parent is the package's "
               "parent, which exists") for piece in ("parents=None", "parents=False",
                                                     "mkdir(exist_ok=True)")),
        ),
        why=CLI_LEVEL),
    "remote_agent": Target(
        "dynspec_patch/patcher/remote_agent.py",
        ("tests/remote/test_mutation_remote_agent.py", "tests/remote/test_remote_pure.py",
         "tests/remote/test_container_pure.py", "tests/codemods/test_mutation_local.py"),
        functions=("x_take_lock", "x_hold_flock", "x_lock_holder", "x_read_json", "x_read_bytes",
                   "x_sha256_file", "x_write_atomic", "x_recover_journal", "x_finish_commit",
                   "x_undo", "x_state_dir_for", "x_is_server_argv", "x_flag_value"),
        equivalent=(
            *((name, piece, "a lock line is under 100 bytes, and codec names are "
               "case-insensitive") for name in ("x_hold_flock", "x_lock_holder")
              for piece in ("os.read(fd, 4097)", 'decode("UTF-8"')),
            ("x_hold_flock", "os.ftruncate(fd, 1)", "the line is then written from offset 0 "
             "and is longer than one byte: the file ends up the same"),
            *(("x_finish_commit", piece, "the restart mark is JSON, read back with read_json: "
               "its indentation is no part of it")
              for piece in ("indent=None", "json.dumps(pending, )", "indent=2")),
        ),
        why="the lock, the journal (finish or undo an interrupted commit) and the server argv "
            "rules, in-process: over SSH the agent runs on the host's own python3, where a "
            "mutant (it imports mutmut) cannot run"),
    "router": Target(
        "dynspec_patch/patcher/router.py", ("tests/remote/test_mutation_router.py",),
        heavy=True,
        functions=("x__same_url", *_methods("RouterClient", "remove", "add"), "x_drain",
                   *_methods("Rotation", "resolve", "_require_another", "before_restart",
                             "add_back")),
        equivalent=(
            ("xǁRouterClientǁremove", 'safe="XXXX"', "quote() never escapes a letter: X is "
             "as safe as nothing"),
            ("xǁRouterClientǁadd", 'self._call(None, "/workers", body)', "urllib's Request "
             "sends POST when it has data and no method, and add always sends a body"),
        ),
        why="the rotation's decisions (never the last healthy worker, drain, add back), one at "
            "a time against the real sglang-router, a stub router and a fake clock; the fleet "
            "tests (test_fleet_router*: whole fleets under load, minutes each here) are left "
            "out of the per-mutant runs"),
    "container": Target(
        "dynspec_patch/patcher/container.py",
        ("tests/remote/test_container_pure.py", "tests/remote/test_mutation_container.py"),
        equivalent=(("x_durability", "rstrip('XX/XX')",
                     "strips X as well as /: a package directory is .../sglang, never ends in X"),
                    ),
        why="the pure decisions' tests; the Docker engine tests (test_remote_container) are "
            "left out of the per-mutant runs"),
    "ssh_host_keys": Target(
        "dynspec_patch/patcher/ssh.py", ("tests/remote/test_mutation_ssh.py",),
        functions=("x__known_hosts_name", *_methods("_AcceptNewPolicy", "__init__",
                                                    "missing_host_key"),
                   *_methods("_RejectPolicy", "missing_host_key"),
                   *_methods("Connection", "__init__")),
        equivalent=(("xǁ_AcceptNewPolicyǁmissing_host_key", "add(hostname, None, key)",
                     "paramiko's HostKeys.add reads the key type only to replace an entry of "
                     "that type, and a missing host has none"),),
        why="the known_hosts policies and the connection's default, on paramiko's objects"),
    "ssh_connect": Target(
        "dynspec_patch/patcher/ssh.py",
        ("tests/remote/test_mutation_ssh_open.py",
         "tests/remote/test_remote_cli.py::test_cli_connection_options_and_host_key_policy"),
        functions=_methods("Connection", "open"), heavy=True,
        why="Connection.open (known_hosts, the host-key policy, keys, agent, certificate, "
            "ProxyCommand, timeouts) against the loopback sshd"),
    "ansible_action": Target(
        "ansible_collections/dynspec/patch/plugins/action/sglang_dynspec.py",
        ("tests/remote/test_mutation_ansible.py",), heavy=True,
        equivalent=(
            *(("xǁActionModuleǁrun", call, "ansible-core's ActionBase.run ignores task_vars, "
               "and ansible passes tmp=None (the only value it does not warn about)")
              for call in ("super().run(None, task_vars)", "super().run(tmp, None)",
                           "super().run(tmp, )")),
            *(("xǁActionModuleǁrun", piece, "ansible's become_method is never empty (it "
               "defaults to sudo)")
              for piece in ('(pc.become_method or "XXsudoXX")', '(pc.become_method or "SUDO")')),
            *(("xǁActionModuleǁrun", piece, "the value is or-ed with \"\" right after: a None "
               "default and a \"\" default give the same empty argument list")
              for piece in ('"ssh_common_args", None) or', '"ssh_common_args", ) or',
                            '"ssh_extra_args", None) or', '"ssh_extra_args", ) or')),
            ("xǁActionModuleǁrun", "_get_remote_addr(task_vars and {})",
             "ansible always passes task_vars, a dict, and ActionBase._get_remote_addr "
             "(ansible-core 2.19) overwrites what it reads from them with the connection's "
             "remote_addr/host option or the play context's remote_addr"),
            ("x__option", "(value is None) and False",
             "with the ssh connection plugin an unset option and the play context's value "
             "come from the same variables: the default is None exactly when the option is"),
        ),
        why="a real ansible-playbook against the loopback sshd; the fleet plays "
            "(test_fleet_ansible: minutes each) are left out of the per-mutant runs"),
}


def stage(name: str, target: Target) -> Path:
    """A fresh ``.mutation/<name>/``: the tree as the package installs, tests, mutmut's config."""
    where = ROOT / ".mutation" / name
    shutil.rmtree(where, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for source, dest in PACKAGE_DIRS.items():
        shutil.copytree(ROOT / source, where / dest, ignore=ignore)
    for tree in ("tests", "ansible_collections"):
        shutil.copytree(ROOT / tree, where / tree, ignore=ignore)
    # ansible-playbook gets PYTHONPATH=<the tree> (tests/remote/fleet_harness.py): mutants/
    shutil.copy2(HITS / "sitecustomize.py", where / "sitecustomize.py")
    mutmut = {
        "source_paths": ["dynspec_patch", "ansible_collections"],
        "only_mutate": [target.path],
        "also_copy": ["sitecustomize.py"],
        "pytest_add_cli_args": PYTEST_ARGS,
        "pytest_add_cli_args_test_selection": list(target.tests),
        "use_git_change_detection": False,
        # mutmut's default (15 x the clean run) calls slow runs on this shared machine timeouts
        "timeout_multiplier": 40.0,
    }
    pytest_ini = {"testpaths": ["tests"],
                  "markers": ["slow: imports real SGLang modules on CPU",
                              "ssh: needs the loopback sshd started by tests/remote fixtures"]}
    (where / "pyproject.toml").write_text(
        "[tool.mutmut]\n" + _toml_table(mutmut) + "\n[tool.pytest.ini_options]\n"
        + _toml_table(pytest_ini))
    return where


def _toml_table(values: dict[str, object]) -> str:
    # json's strings and lists are valid TOML for these plain values
    return "".join(f"{key} = {json.dumps(value, ensure_ascii=False)}\n"
                   for key, value in values.items())


def run_mutmut(where: Path, target: Target, max_children: int) -> int:
    # made before Python starts: a PYTHONPATH entry that does not exist yet is cached as absent
    (where / "mutants").mkdir(exist_ok=True)
    # tests/conftest.py stops any session that does not run the installed wheel, except the
    # stage's own copy, which tests the mutants on purpose
    env = {**os.environ, "PYTHONPATH": f"{where / 'mutants'}{os.pathsep}{HITS}",
           "DYNSPEC_OFFLINE": "1", "DYNSPEC_MUTATION_STAGE": str((where / "mutants").resolve()),
           # mutmut forks each mutant from a parent that ran torch: an OpenMP pool made before
           # the fork hangs the child's first parallel op (a stand-in's softmax, on futex)
           "OMP_NUM_THREADS": "1"}
    command = ["nice", "-n", "10", sys.executable, "-m", "mutmut", "run",
               "--max-children", str(max_children), *target.patterns()]
    if target.heavy:
        command = ["flock", HEAVY_LOCK, *command]
    log = where / "mutmut.log"
    with log.open("w") as out:
        return subprocess.run(command, cwd=where, env=env, stdout=out, stderr=subprocess.STDOUT,
                              check=False).returncode


@dataclass
class Outcome:
    counts: Counter[str] = field(default_factory=Counter)
    survivors: list[str] = field(default_factory=list)
    equivalents: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def outcome(where: Path, target: Target) -> Outcome:
    from mutmut.stats import status_by_exit_code

    meta = json.loads((where / "mutants" / (target.path + ".meta")).read_text())
    result = Outcome()
    for mutant, exit_code in sorted(meta["exit_code_by_key"].items()):
        if not any(fnmatch.fnmatchcase(mutant, pattern) for pattern in target.patterns()):
            continue
        status = status_by_exit_code[exit_code]
        if status == "survived" and (why := _equivalent(where, target, mutant)):
            status = "equivalent"
            result.equivalents.append(f"{mutant}: {why}")
        result.counts[status] += 1
        if status not in ("killed", "equivalent", "not checked"):
            result.survivors.append(f"{mutant} ({status})")
    return result


def _equivalent(where: Path, target: Target, mutant: str) -> str | None:
    function = mutant.removeprefix(target.module + ".").partition("__mutmut_")[0]
    reviewed = [(piece, why) for name, piece, why in target.equivalent if name == function]
    if not reviewed:
        return None
    added = [line for line in show(where, mutant).splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    return next((why for piece, why in reviewed if any(piece in line for line in added)), None)


def show(where: Path, mutant: str) -> str:
    return subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], cwd=where,
                          capture_output=True, text=True, check=False).stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", metavar="MODULE",
                        help=f"one of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--max-children", type=int, default=2, help="parallel mutants (2)")
    parser.add_argument("--survivors", action="store_true", help="print each survivor's diff")
    parser.add_argument("--sample", metavar="DIGITS",
                        help="only mutants whose number ends in one of DIGITS (e.g. 0: a tenth)")
    parser.add_argument("--report-only", action="store_true",
                        help="print the table of the last run, run nothing")
    args = parser.parse_args(argv)
    if unknown := [name for name in args.modules if name not in TARGETS]:
        parser.error(f"unknown module {', '.join(unknown)}: one of {', '.join(TARGETS)}")
    rows = []
    for name in args.modules or TARGETS:
        target = TARGETS[name]
        if args.sample is not None:
            target = dataclasses.replace(target, sample=args.sample)
        where = ROOT / ".mutation" / name
        if not args.report_only:
            where = stage(name, target)
            print(f"== {name}: mutmut over {', '.join(target.tests)} (log: {where}/mutmut.log)",
                  flush=True)
            if target.sample:
                print(f"   sampled: the mutants numbered *[{target.sample}] only", flush=True)
            if run_mutmut(where, target, args.max_children) != 0:
                print(f"   mutmut failed: see {where}/mutmut.log", flush=True)
        try:
            result = outcome(where, target)
        except FileNotFoundError:
            print(f"   {name}: no results", flush=True)
            continue
        rows.append((name, result))
        for equivalent in result.equivalents:
            print(f"   equivalent: {equivalent}")
        for survivor in result.survivors:
            print(f"   survived: {survivor}")
            if args.survivors:
                print(show(where, survivor.split(" ")[0]))
    print()
    print("% killed: killed / (mutants run - reviewed equivalents); a timeout is not a kill; "
          "other: mutmut's suspicious (the test process died) and the like")
    print(f"{'module':<16} {'mutants':>7} {'not run':>7} {'killed':>6} {'survived':>8} "
          f"{'timeout':>7} {'no tests':>8} {'other':>5} {'equiv.':>6} {'% killed':>8}")
    for name, result in rows:
        counts = result.counts
        named = ("killed", "survived", "timeout", "no tests", "equivalent", "not checked")
        other = result.total - sum(counts[k] for k in named)
        judged = result.total - counts["equivalent"] - counts["not checked"]
        share = 100 * counts["killed"] / judged if judged else 0.0
        print(f"{name:<16} {result.total:>7} {counts['not checked']:>7} {counts['killed']:>6} "
              f"{counts['survived']:>8} {counts['timeout']:>7} {counts['no tests']:>8} "
              f"{other:>5} {counts['equivalent']:>6} {share:>7.1f}%")
    print()
    for name, _result in rows:
        target = TARGETS[name]
        scope = (f"functions: {', '.join(target.functions)}" if target.functions
                 else "every function")
        sample = f", mutants numbered *[{target.sample}]" if target.sample else ""
        print(f"{name}: {target.path}; {scope}{sample}; tests: {', '.join(target.tests)}"
              + (f" ({target.why})" if target.why else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
