"""Each codemod as before/after text, compared byte for byte (libcst's style, without its
whitespace normalisation), plus the states it must refuse."""

from __future__ import annotations

import textwrap

import pytest

from dynspec_patch.transforms import (
    AddDisableThresholdArgCommand,
    HookEagleWorkerCommand,
    HookEagleWorkerV2Command,
    InstallRuntimeModuleCommand,
)
from dynspec_patch.transforms.markers import Patched, Unknown, Unpatched


def src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


V1_BEFORE = src('''
    """EAGLE worker."""
    import logging

    from sglang.srt.managers.schedule_batch import ScheduleBatch

    logger = logging.getLogger(__name__)


    class EAGLEWorker(TpModelWorker):
        def forward_batch_generation(self, batch: ScheduleBatch):
            """Run one step."""
            # decode or extend
            if batch.forward_mode.is_extend():
                return self.extend(batch)
            return self.decode(batch)
''')

V1_AFTER = src('''
    """EAGLE worker."""
    import logging

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative import dynspec_fallback  # dynspec-patch 0.1.0

    logger = logging.getLogger(__name__)


    class EAGLEWorker(TpModelWorker):
        def forward_batch_generation(self, batch: ScheduleBatch):
            """Run one step."""
            _dynspec_out = dynspec_fallback.maybe_fallback_v1(self, batch)  # dynspec-patch 0.1.0
            if _dynspec_out is not None:  # dynspec-patch 0.1.0
                return _dynspec_out
            # decode or extend
            if batch.forward_mode.is_extend():
                return self.extend(batch)
            return self.decode(batch)
''')


def test_v1_hook_before_after():
    codemod = HookEagleWorkerCommand()
    analysis = codemod.analyse(V1_BEFORE)
    assert analysis.state == Unpatched()
    assert codemod.apply(analysis) == V1_AFTER
    again = codemod.analyse(V1_AFTER)
    assert again.state == Patched("0.1.0")
    assert codemod.apply(again) == V1_AFTER
    assert codemod.revert(again) == V1_BEFORE


def test_v1_hook_uses_the_old_entry_name_and_its_parameter_name():
    before = src("""
        class EAGLEWorker:
            def forward_batch_speculative_generation(self, sched_batch):
                return 1
    """)
    after = HookEagleWorkerCommand().apply(HookEagleWorkerCommand().analyse(before))
    assert "maybe_fallback_v1(self, sched_batch)" in after
    assert after.startswith("from sglang.srt.speculative import dynspec_fallback")


def test_v2_hook_forwards_the_other_parameters_as_keywords():
    before = src("""
        import torch


        class EAGLEWorkerV2(BaseSpecWorker):
            def forward_batch_generation(self, batch, on_publish=None, *, grammar_barrier=None):
                return batch
    """)
    codemod = HookEagleWorkerV2Command()
    after = codemod.apply(codemod.analyse(before))
    assert (
        "_dynspec_out = dynspec_fallback.maybe_fallback_v2("
        "self, batch, on_publish=on_publish, grammar_barrier=grammar_barrier)"
    ) in after


def test_v2_beta_subclass_is_refused():
    before = src("""
        class EAGLEWorkerV2(EAGLEWorker):
            def forward_batch_generation(self, model_worker_batch):
                return None
    """)
    analysis = HookEagleWorkerV2Command().analyse(before)
    assert analysis.state == Unpatched()
    assert "beta" in analysis.refusal
    with pytest.raises(ValueError, match="refused"):
        HookEagleWorkerV2Command().apply(analysis)


SERVER_ARGS_BEFORE = src("""
    import argparse
    import dataclasses
    from typing import List, Optional


    @dataclasses.dataclass
    class ServerArgs:
        speculative_num_steps: Optional[int] = None
        speculative_num_draft_tokens: Optional[int] = None
        speculative_eagle_topk: Optional[int] = None

        def __post_init__(self):
            self._handle_speculative_decoding()

        def _handle_speculative_decoding(self):
            if self.speculative_num_steps is None:
                self.speculative_num_steps = 3

        @staticmethod
        def add_cli_args(p: argparse.ArgumentParser):
            if True:
                p.add_argument(
                    "--speculative-num-draft-tokens",
                    type=int,
                    default=ServerArgs.speculative_num_draft_tokens,
                )
            p.add_argument("--speculative-eagle-topk", type=int)
""")

SERVER_ARGS_AFTER = src("""
    import argparse
    import dataclasses
    from typing import List, Optional
    def _dynspec_threshold_arg(value):  # dynspec-patch 0.1.0
        \"\"\"--speculative-disable-batch-threshold: an integer 1..65536, or auto.\"\"\"
        import argparse

        word = value.strip().lower()
        if word == "auto":
            return word
        if word.isdigit() and 1 <= int(word) <= 65536:
            return int(word)
        raise argparse.ArgumentTypeError(
            f"expected an integer 1..65536 or auto, got {value!r}"
        )


    @dataclasses.dataclass
    class ServerArgs:
        speculative_num_steps: Optional[int] = None
        speculative_num_draft_tokens: Optional[int] = None
        speculative_disable_batch_threshold: Optional[int] = None  # dynspec-patch 0.1.0
        speculative_disable_resume_below: Optional[int] = None  # dynspec-patch 0.1.0
        speculative_disable_min_dwell_steps: int = 8  # dynspec-patch 0.1.0
        speculative_eagle_topk: Optional[int] = None

        def __post_init__(self):
            self._handle_speculative_decoding()

        def _handle_speculative_decoding(self):
            if self.speculative_disable_batch_threshold is not None and self.speculative_disable_batch_threshold != "auto" and (not isinstance(self.speculative_disable_batch_threshold, int) or self.speculative_disable_batch_threshold < 1 or self.speculative_disable_batch_threshold > 65536):  # dynspec-patch 0.1.0
                raise ValueError(f"--speculative-disable-batch-threshold must be an integer 1..65536 or auto, got {self.speculative_disable_batch_threshold}")
            if self.speculative_disable_resume_below is not None and self.speculative_disable_batch_threshold == "auto":  # dynspec-patch 0.1.0
                raise ValueError(f"--speculative-disable-resume-below applies to a fixed --speculative-disable-batch-threshold, not auto, got {self.speculative_disable_resume_below}")
            if self.speculative_disable_resume_below is not None and not 1 <= self.speculative_disable_resume_below <= (self.speculative_disable_batch_threshold or 0):  # dynspec-patch 0.1.0
                raise ValueError(f"--speculative-disable-resume-below must be between 1 and --speculative-disable-batch-threshold, got {self.speculative_disable_resume_below}")
            if self.speculative_disable_min_dwell_steps < 1:  # dynspec-patch 0.1.0
                raise ValueError(f"--speculative-disable-min-dwell-steps must be >= 1, got {self.speculative_disable_min_dwell_steps}")
            if self.speculative_num_steps is None:
                self.speculative_num_steps = 3

        @staticmethod
        def add_cli_args(p: argparse.ArgumentParser):
            if True:
                p.add_argument(
                    "--speculative-num-draft-tokens",
                    type=int,
                    default=ServerArgs.speculative_num_draft_tokens,
                )
                p.add_argument(
                    "--speculative-disable-batch-threshold",
                    type=_dynspec_threshold_arg,
                    default=ServerArgs.speculative_disable_batch_threshold,
                    help="Run plain (non-speculative) decode steps while the decode batch is larger than this; speculation resumes when it drops. auto: choose each decode step by expected throughput. Default: off.",
                )  # dynspec-patch 0.1.0
                p.add_argument(
                    "--speculative-disable-resume-below",
                    type=int,
                    default=ServerArgs.speculative_disable_resume_below,
                    help="Resume speculation once the decode batch is at most this (default: T - max(1, T // 8), at least 1).",
                )  # dynspec-patch 0.1.0
                p.add_argument(
                    "--speculative-disable-min-dwell-steps",
                    type=int,
                    default=ServerArgs.speculative_disable_min_dwell_steps,
                    help="Decode steps to stay in one mode (speculative or plain) before switching again.",
                )  # dynspec-patch 0.1.0
            p.add_argument("--speculative-eagle-topk", type=int)
""")  # noqa: E501


def test_server_args_before_after_nested_flag_and_parser_name():
    codemod = AddDisableThresholdArgCommand()
    after = codemod.apply(codemod.analyse(SERVER_ARGS_BEFORE))
    assert after == SERVER_ARGS_AFTER
    assert codemod.revert(codemod.analyse(after)) == SERVER_ARGS_BEFORE


def test_server_args_check_goes_into_post_init_on_old_layouts():
    before = SERVER_ARGS_BEFORE.replace("_handle_speculative_decoding", "_other")
    after = AddDisableThresholdArgCommand().apply(AddDisableThresholdArgCommand().analyse(before))
    post_init = after.split("def __post_init__(self):\n", 1)[1]
    assert post_init.lstrip().startswith("if self.speculative_disable_batch_threshold is not None")


def test_server_args_threshold_check_really_rejects_zero():
    codemod = AddDisableThresholdArgCommand()
    namespace: dict[str, object] = {}
    exec(compile(codemod.apply(codemod.analyse(SERVER_ARGS_BEFORE)), "sa", "exec"), namespace)
    server_args = namespace["ServerArgs"]
    assert (
        server_args(speculative_disable_batch_threshold=4).speculative_disable_batch_threshold == 4
    )
    with pytest.raises(ValueError, match=r"an integer 1\.\.65536 or auto, got 0"):
        server_args(speculative_disable_batch_threshold=0)
    with pytest.raises(ValueError, match="resume-below must be between 1 and"):
        server_args(speculative_disable_batch_threshold=4, speculative_disable_resume_below=5)
    with pytest.raises(ValueError, match="resume-below must be between 1 and"):
        server_args(speculative_disable_resume_below=2)  # no threshold: nothing to resume to
    with pytest.raises(ValueError, match="dwell-steps must be >= 1, got 0"):
        server_args(speculative_disable_min_dwell_steps=0)
    both = server_args(speculative_disable_batch_threshold=4, speculative_disable_resume_below=4)
    assert both.speculative_disable_resume_below == 4
    import argparse

    parser = argparse.ArgumentParser()
    server_args.add_cli_args(parser)
    args = parser.parse_args(
        ["--speculative-disable-batch-threshold", "12", "--speculative-disable-resume-below", "9"]
    )
    assert args.speculative_disable_batch_threshold == 12
    assert args.speculative_disable_resume_below == 9
    defaults = parser.parse_args([])
    assert defaults.speculative_disable_batch_threshold is None
    assert defaults.speculative_disable_min_dwell_steps == 8


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (
            lambda s: s.replace("    speculative_num_draft_tokens: Optional[int] = None\n", ""),
            "anchor",
        ),
        (
            lambda s: s.replace("from typing import List, Optional", "from typing import List"),
            "Optional",
        ),
        (lambda s: s.replace('"--speculative-num-draft-tokens"', '"--other"'), "add_argument"),
    ],
)
def test_server_args_missing_anchor_is_unknown(edit, reason):
    analysis = AddDisableThresholdArgCommand().analyse(edit(SERVER_ARGS_BEFORE))
    assert isinstance(analysis.state, Unknown)
    assert reason in analysis.refusal


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda s: s.replace("  # dynspec-patch 0.1.0", ""), "no dynspec-patch marker"),
        (
            lambda s: s.replace("dynspec_fallback  # dynspec-patch 0.1.0", "dynspec_fallback"),
            "differs",
        ),
        (
            lambda s: s.replace(
                "if _dynspec_out is not None:  # dynspec-patch 0.1.0",
                "if _dynspec_out is not None:  # dynspec-patch 0.2.0",
            ),
            "several tool versions",
        ),
        (lambda s: s.replace("return _dynspec_out", "return None"), "differs"),
        (lambda s: s + "# see dynspec_fallback\n", "outside"),
        (
            lambda s: s.replace(
                "        if _dynspec_out is not None:  # dynspec-patch 0.1.0\n"
                "            return _dynspec_out\n",
                "",
            ),
            "differs",
        ),
    ],
)
def test_hand_edits_of_a_patched_file_are_unknown(edit, reason):
    edited = edit(V1_AFTER)
    assert edited != V1_AFTER
    analysis = HookEagleWorkerCommand().analyse(edited)
    assert isinstance(analysis.state, Unknown)
    assert reason in analysis.refusal
    with pytest.raises(ValueError):
        HookEagleWorkerCommand().revert(analysis)


def test_runtime_module_install_detects_edits_and_foreign_files():
    codemod = InstallRuntimeModuleCommand(body="def maybe_fallback_v1(w, b):\n    return None\n")
    installed = codemod.apply(codemod.analyse(None))
    assert installed.startswith("# dynspec-patch 0.1.0 sha256=")
    assert codemod.analyse(installed).state == Patched("0.1.0")
    assert codemod.revert(codemod.analyse(installed)) is None
    edited = installed.replace("return None", "return 1")
    assert "edited" in codemod.analyse(edited).refusal
    assert "did not write" in codemod.analyse("x = 1\n").refusal


def test_crlf_and_tab_indented_files_round_trip_exactly():
    before = V1_BEFORE.replace("    ", "\t").replace("\n", "\r\n")
    codemod = HookEagleWorkerCommand()
    after = codemod.apply(codemod.analyse(before))
    assert "\r\n\t\t_dynspec_out = dynspec_fallback" in after
    assert "\n" not in after.replace("\r\n", "")
    assert codemod.revert(codemod.analyse(after)) == before
