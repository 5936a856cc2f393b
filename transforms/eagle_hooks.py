"""Hook ``dynspec_fallback`` into the EAGLE workers' per-batch entry points."""

from __future__ import annotations

import libcst as cst

from dynspec_patch.transforms.statements import (
    AnchorMissing,
    Insertion,
    MarkedInsertionCodemod,
    after_leading_imports,
    find_class,
    find_method,
    first_statement_index,
)

RUNTIME_IMPORT = "from sglang.srt.speculative import dynspec_fallback"


def _call_arguments(method: cst.FunctionDef) -> str:
    """``batch`` or ``batch, on_publish=on_publish``: the method's own parameters, passed on."""
    params = method.params
    if isinstance(params.star_arg, cst.Param) or params.star_kwarg is not None:
        raise AnchorMissing(f"{method.name.value} takes *args/**kwargs; cannot forward them")
    names = [param.name.value for param in (*params.posonly_params, *params.params)]
    if len(names) < 2 or names[0] != "self":
        raise AnchorMissing(f"{method.name.value} has no batch parameter after self")
    keywords = [param.name.value for param in params.kwonly_params]
    first, rest = names[1], names[2:] + keywords
    return ", ".join([first, *(f"{name}={name}" for name in rest)])


class _WorkerHook(MarkedInsertionCodemod):
    CLASS: str
    METHODS: tuple[str, ...]
    FUNCTION: str

    def insertions(self, module: cst.Module) -> list[Insertion]:
        class_index, cls = find_class(module, self.CLASS)
        method_index, method = find_method(cls, self.METHODS)
        call = f"dynspec_fallback.{self.FUNCTION}(self, {_call_arguments(method)})"
        hook_block = (class_index, method_index)
        hook_index = first_statement_index(method.body)
        return [
            Insertion((), after_leading_imports(module), RUNTIME_IMPORT),
            Insertion(hook_block, hook_index, f"_dynspec_out = {call}"),
            Insertion(
                hook_block, hook_index, "if _dynspec_out is not None:\n    return _dynspec_out"
            ),
        ]


class HookEagleWorkerCommand(_WorkerHook):
    """Make ``EAGLEWorker`` (v1) ask ``maybe_fallback_v1`` first on every batch.

    The hook opens ``forward_batch_speculative_generation`` (≤ 0.5.2) or
    ``forward_batch_generation`` (0.5.3 – 0.5.12.post1), after the docstring.
    """

    NAME = "v1"
    DESCRIPTION = "EAGLEWorker hook calling dynspec_fallback.maybe_fallback_v1"
    PATH = "srt/speculative/eagle_worker.py"
    CLASS = "EAGLEWorker"
    METHODS = ("forward_batch_speculative_generation", "forward_batch_generation")
    FUNCTION = "maybe_fallback_v1"


class HookEagleWorkerV2Command(_WorkerHook):
    """Make ``EAGLEWorkerV2`` ask ``maybe_fallback_v2`` first in ``forward_batch_generation``.

    Every other parameter is passed on: ``on_publish`` (0.5.13+), ``grammar_barrier``
    (0.5.17+), ``pp_proxy_tensors`` (0.5.19+). Refuses the beta V2 of 0.5.3.post2–post3 (a
    subclass of ``EAGLEWorker``). ``native_steps_zero`` (``_build_trivial_verify_input``,
    0.5.14+) marks the releases that also offer the native route.
    """

    NAME = "v2"
    DESCRIPTION = "EAGLEWorkerV2 hook calling dynspec_fallback.maybe_fallback_v2"
    PATH = "srt/speculative/eagle_worker_v2.py"
    CLASS = "EAGLEWorkerV2"
    METHODS = ("forward_batch_generation",)
    FUNCTION = "maybe_fallback_v2"

    def facts(self, module: cst.Module) -> dict[str, object]:
        try:
            _, cls = find_class(module, self.CLASS)
        except AnchorMissing:
            return {}
        bases = [arg.value.value for arg in cls.bases if isinstance(arg.value, cst.Name)]
        methods = {s.name.value for s in cls.body.body if isinstance(s, cst.FunctionDef)}
        return {
            "beta_subclass": "EAGLEWorker" in bases,
            "native_steps_zero": "_build_trivial_verify_input" in methods,
        }

    def refusal(self, module: cst.Module, facts: dict[str, object]) -> str | None:
        if facts.get("beta_subclass"):
            return (
                "EAGLEWorkerV2 here is the beta subclass of EAGLEWorker (0.5.3.post2–post3, "
                "--enable-beta-spec); it is not patched. The default worker is v1: --worker v1"
            )
        return None
