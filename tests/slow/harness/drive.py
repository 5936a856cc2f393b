"""Run inside an import-check venv: import a PATCHED release and report what happened, as JSON.

    python drive.py CHECK VARIANT          (PYTHONPATH = stubs : harness : <patched tree parent>)

CHECK is one of:
  wiring        the patched module imports, its hook is the first statement of the entry
                method and calls the installed dynspec_fallback; ServerArgs has the field
                and the flag
  steps         fallback decode steps end to end through the real worker entry (v1 or v2)
  at_threshold  bs == T: the hook returns None and the worker's own body runs
  cycle         spec -> fallback -> spec through the worker's real speculative path
  steps_graphs  v2 "steps" with draft-extend graphs (harness/cpu_graphs.py): the
                runtime captures width-1 ones and fallback steps replay them
  cycle_graphs  v2 "cycle" with the same graphs
  all           every check above for VARIANT, each reported separately (what pytest runs)

The JSON goes to stdout's last line; the pytest side asserts on it. Nothing is asserted here
except "this must not happen" conditions the harness itself relies on.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import json
import logging
import sys
import textwrap
import traceback
from types import SimpleNamespace
from typing import Any

import cpu_graphs
import torch
import world
from cpu_device import CudaAsCpu

HOOK_PREFIX = "_dynspec_out = dynspec_fallback.maybe_fallback_"


def entry_name(release: world.Release) -> str:
    names = ["forward_batch_speculative_generation", "forward_batch_generation"]
    if release.variant == "v2":
        names = names[1:]
    for name in names:
        if name in vars(release.worker_cls):
            return name
    raise AssertionError(f"no entry method on {release.worker_cls.__name__}")


def first_statements(fn: Any, count: int) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    return [ast.unparse(stmt) for stmt in body[:count]]


def check_wiring(variant: str) -> dict[str, Any]:
    release = world.import_release(variant)
    entry = entry_name(release)
    method = getattr(release.worker_cls, entry)
    bound_fallback = vars(release.worker_mod).get("dynspec_fallback")
    sa_mod = sys.modules["sglang.srt.server_args"]
    fields = {f.name: f.default for f in sa_mod.dataclasses.fields(sa_mod.ServerArgs)} if hasattr(
        sa_mod, "dataclasses") else {}
    if not fields:
        import dataclasses

        fields = {f.name: f.default for f in dataclasses.fields(sa_mod.ServerArgs)}
    parser = argparse.ArgumentParser()
    sa_mod.ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(
        ["--model-path", "toy", "--speculative-disable-batch-threshold", "6"]
    )
    # Call the real entry with a recording fallback: proves the hook is live, not just present.
    seen: list[tuple[Any, ...]] = []
    sentinel = object()
    hook_name = f"maybe_fallback_{variant}"
    original = getattr(bound_fallback, hook_name)

    def recorder(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        return sentinel

    setattr(bound_fallback, hook_name, recorder)
    try:
        worker = object.__new__(release.worker_cls)
        batch = object()
        returned = method(worker, batch)
    finally:
        setattr(bound_fallback, hook_name, original)
    args, kwargs = seen[0] if seen else ((), {})
    return {
        "live_names": _live_module_names(release) if variant == "v2" else {},
        "entry": entry,
        "first_statements": first_statements(method, 2),
        "fallback_module_file": getattr(bound_fallback, "__file__", None),
        "fallback_is_installed_module": bound_fallback
        is sys.modules.get(f"{world.SPEC}.dynspec_fallback"),
        "worker_module_file": release.worker_mod.__file__,
        "hook_calls": len(seen),
        "hook_got_worker_and_batch": bool(seen) and args[0] is worker and args[1] is batch,
        "hook_kwargs": sorted(kwargs),
        "entry_returned_hook_value": returned is sentinel,
        "server_args_field_default": repr(fields.get("speculative_disable_batch_threshold",
                                                     "MISSING")),
        "cli_flag_value": getattr(parsed, "speculative_disable_batch_threshold", "MISSING"),
        "kernel_placements": release.kernel_placements,
    }


# Need scopes answered from module globals and classes alone (no worker instance needed).
MODULE_SCOPES = ("module", "verify_module", "fn_param", "fields", "member", "param")


def _live_module_names(release: world.Release) -> dict[str, Any]:
    """What the installed runtime resolves, from the real modules, for the module-level needs
    (the pytest side compares it with the static probe of the same tree)."""
    fallback = release.fallback_mod
    needs = tuple(n for n in fallback.V2_NEEDS if n.scope in MODULE_SCOPES)
    worker = object.__new__(release.worker_cls)
    names, missing = fallback.resolve_needs(
        needs, fallback._live_has(worker, vars(release.worker_mod))
    )
    return {"names": names, "missing": [n.key for n in missing]}


def _snapshot_reqs(batch: Any) -> list[dict[str, Any]]:
    return [
        {
            "rid": req.rid,
            "output_ids": list(req.output_ids),
            "finished": bool(req.finished()),
            "kv_committed_len": getattr(req, "kv_committed_len", None),
        }
        for req in batch.reqs
    ]


def _result_summary(result: Any) -> dict[str, Any]:
    if result is None:
        return {"kind": "None"}
    if isinstance(result, tuple):
        tokens = result[1]
        return {"kind": "tuple", "arity": len(result), "tokens": tokens.tolist(),
                "count": result[3]}
    summary: dict[str, Any] = {"kind": type(result).__name__}
    for name in ("num_accepted_tokens", "num_accepted_drafts", "num_correct_drafts",
                 "accept_length_per_req_cpu", "num_accepted_drafts_per_req_cpu",
                 "num_correct_drafts_per_req_cpu", "can_run_cuda_graph"):
        if hasattr(result, name):
            summary[name] = getattr(result, name)
    summary["tokens"] = result.next_token_ids.tolist()
    return summary


def _root_of(spec_info: Any) -> list[int] | None:
    for name in ("bonus_tokens", "verified_id"):
        value = getattr(spec_info, name, None)
        if value is not None:
            return value.tolist()
    return None


def _root_dtype(spec_info: Any) -> str | None:
    for name in ("bonus_tokens", "verified_id"):
        value = getattr(spec_info, name, None)
        if value is not None:
            return str(value.dtype)
    return None


def check_steps(variant: str, steps: int, threshold: int) -> dict[str, Any]:
    """v1: run ``steps`` decode steps through the patched entry of the real EAGLEWorker."""
    release = world.import_release(variant)
    args = world.server_args(threshold)
    req_to_token_pool, allocator = world.memory()
    total_slots = allocator.available_size()
    specs = [
        world.RequestSpec(prompt=[3, 5, 7, 11, 13], first_token=11, max_new_tokens=8),
        world.RequestSpec(prompt=list(range(20, 29)), first_token=22, max_new_tokens=3),
        world.RequestSpec(prompt=list(range(40, 52)), first_token=33, max_new_tokens=40),
    ]
    batch = world.prefilled_batch(release, args, specs, req_to_token_pool, allocator)
    batch_ref = [batch]
    worker = world.v1_worker(release, args, req_to_token_pool, allocator, batch_ref)
    entry = getattr(release.worker_cls, entry_name(release))
    report: dict[str, Any] = {
        "entry": entry_name(release),
        "total_slots": total_slots,
        "initial": {"seq_lens": batch.seq_lens.tolist(), "reqs": _snapshot_reqs(batch)},
        "steps": [],
    }
    for _ in range(steps):
        if not batch.reqs:
            break
        before = {
            "seq_lens": batch.seq_lens.tolist(),
            "seq_lens_id": id(batch.seq_lens),
            "free": allocator.available_size(),
            "root": _root_of(batch.spec_info),
            "rids": [r.rid for r in batch.reqs],
        }
        n_target = len(worker.target_worker.calls)
        n_draft = len(worker.draft_model_runner.calls)
        with CudaAsCpu():
            result = entry(worker, batch)
        after_rows = {
            r.rid: batch.req_to_token_pool.req_to_token[r.req_pool_idx, : int(length)].tolist()
            for r, length in zip(batch.reqs, batch.seq_lens.tolist(), strict=True)
        }
        step = {
            "before": before,
            "result": _result_summary(result),
            "target_calls": [vars(c) for c in worker.target_worker.calls[n_target:]],
            "draft_calls": [vars(c) for c in worker.draft_model_runner.calls[n_draft:]],
            "graph_attr_after": repr(getattr(worker.target_worker.model_runner,
                                             worker.target_worker.graph_attr)),
            "seq_lens_after": batch.seq_lens.tolist(),
            "forward_mode_after": batch.forward_mode.name,
            "spec_info_type": type(batch.spec_info).__name__,
            "spec_root_after": _root_of(batch.spec_info),
            "topk_index_after": getattr(batch.spec_info, "topk_index", None).tolist()
            if getattr(batch.spec_info, "topk_index", None) is not None else None,
            "hidden_after": batch.spec_info.hidden_states[:, :3].tolist()
            if getattr(batch.spec_info, "hidden_states", None) is not None else None,
            "reqs": _snapshot_reqs(batch),
            "req_to_token_rows": after_rows,
            "free_after_step": allocator.available_size(),
            "adaptive_calls": list(getattr(worker, "adaptive_controller", None).calls)
            if hasattr(worker, "adaptive_controller") else [],
        }
        # What the scheduler does next (v1): release finished requests, drop them from the
        # batch, trusting that spec_info already holds only the unfinished ones.
        world.release_finished(batch)
        world.call(batch.filter_batch, v1_spec_info_filtered=True)
        step["rids_after_filter"] = [r.rid for r in batch.reqs]
        step["spec_root_after_filter"] = _root_of(batch.spec_info) if batch.reqs else []
        step["free_after_release"] = allocator.available_size()
        step["live_kv"] = sum(
            int(getattr(r, "kv_committed_len", 0) or 0) for r in batch.reqs
        ) if batch.reqs and hasattr(batch.reqs[0], "kv_committed_len") else None
        step["seq_lens_after_filter"] = batch.seq_lens.tolist() if batch.reqs else []
        report["steps"].append(step)
    adapter = release.fallback_mod._adapters.get(release.worker_cls)
    controller = getattr(adapter, "controller", None)
    report["controller"] = {
        "fallback_steps": getattr(controller, "n_fallback_steps", None),
        "spec_steps": getattr(controller, "n_spec_steps", None),
        "switches": getattr(controller, "n_switches", None),
    }
    report["adapter_names"] = getattr(adapter, "names", None)
    return report


class SpecPathEntered(Exception):
    """Raised by the spy on worker.draft: the hook returned None and the original body ran."""


def check_at_threshold(variant: str) -> dict[str, Any]:
    """bs == T must keep speculating: the hook returns None and the worker's own body runs
    (up to its draft call, where a spy stops it)."""
    release = world.import_release(variant)
    specs = [world.RequestSpec(prompt=[1, 2, 3], first_token=5, max_new_tokens=9)] * 3
    args = world.server_args(threshold=len(specs))
    req_to_token_pool, allocator = world.memory()
    drafted: list[int] = []

    def draft_spy(batch_arg: Any) -> Any:
        drafted.append(len(batch_arg.seq_lens))
        raise SpecPathEntered

    if variant == "v1":
        batch = world.prefilled_batch(release, args, specs, req_to_token_pool, allocator)
        worker = world.v1_worker(release, args, req_to_token_pool, allocator, [batch])
        worker.draft = draft_spy
        step_input = batch
    else:
        batch = world.v2_decode_batch(release, args, specs, req_to_token_pool, allocator)
        batch.prepare_for_decode()
        step_input = batch.get_model_worker_batch()
        worker = world.v2_worker(release, args, req_to_token_pool, allocator, [step_input])
        worker.draft_worker.draft = draft_spy
    entered = False
    try:
        with CudaAsCpu():
            getattr(release.worker_cls, entry_name(release))(worker, step_input)
    except SpecPathEntered:
        entered = True
    adapter = release.fallback_mod._adapters.get(release.worker_cls)
    return {
        "spec_path_entered": entered,
        "draft_batch_sizes": drafted,
        "target_calls": len(worker.target_worker.calls),
        "threshold": args.speculative_disable_batch_threshold,
        "controller_spec_steps": getattr(getattr(adapter, "controller", None), "n_spec_steps",
                                         None),
    }


def _v2_stride(result: Any, worker: Any) -> int:
    """Where the scheduler reads the output stride: the result (0.5.12.post1+) or the draft
    worker's current attribute (older), fallback-design.md §5.2."""
    stride = getattr(result, "speculative_num_draft_tokens", None)
    return int(stride if stride is not None else worker.draft_worker.speculative_num_draft_tokens)


def _v2_run_step(release: Any, worker: Any, batch: Any, batch_ref: list[Any],
                 allocator: Any) -> dict[str, Any]:
    """One v2 step as the overlap scheduler runs it, then its output processing."""
    batch.prepare_for_decode()  # real: over-allocation + req_to_token for the next slots
    mwb = batch.get_model_worker_batch()
    seq_lens_tensor = mwb.seq_lens
    before = {
        "seq_lens": mwb.seq_lens.tolist(),
        "root": _root_of(mwb.spec_info),
        "rids": [r.rid for r in batch.reqs],
        "outputs": {r.rid: len(r.output_ids) for r in batch.reqs},
        "allocated_rows": {
            r.rid: batch.req_to_token_pool.req_to_token[r.req_pool_idx,
                                                        : r.kv_allocated_len].tolist()
            for r in batch.reqs
        },
    }
    batch_ref[0] = mwb
    n_target = len(worker.target_worker.calls)
    n_draft = len(worker.draft_worker.draft_runner.calls)
    with CudaAsCpu():
        result = release.worker_cls.forward_batch_generation(worker, mwb)
    stride = _v2_stride(result, worker)
    next_input = result.next_draft_input
    new_seq_lens = getattr(result, "new_seq_lens", None)
    if new_seq_lens is None:
        new_seq_lens = next_input.new_seq_lens
    target_calls = [vars(c) for c in worker.target_worker.calls[n_target:]]
    step = {
        "before": before,
        "mode": target_calls[0]["forward_mode"] if target_calls else None,
        "seq_lens_tensor_untouched": seq_lens_tensor.tolist() == before["seq_lens"],
        "result_type": type(result).__name__,
        "next_token_ids": result.next_token_ids.tolist(),
        "accept_lens": result.accept_lens.tolist(),
        "stride": stride,
        "new_seq_lens": new_seq_lens.tolist(),
        "next_root": _root_of(next_input),
        "next_root_dtype": _root_dtype(next_input),
        "next_topk_index": next_input.topk_index.tolist(),
        "next_hidden": next_input.hidden_states[:, :3].tolist(),
        "target_calls": target_calls,
        "draft_calls": [vars(c) for c in worker.draft_worker.draft_runner.calls[n_draft:]],
        "graph_attr_after": repr(getattr(worker.target_worker.model_runner,
                                         worker.target_worker.graph_attr)),
    }
    # The scheduler's output processing (0.5.10 _resolve_spec_overlap_token_ids and
    # process_batch_result_decode, reduced to the token and KV bookkeeping).
    tokens = result.next_token_ids.tolist()
    for i, (req, accepted) in enumerate(zip(batch.reqs, step["accept_lens"], strict=True)):
        for token in tokens[i * stride : i * stride + accepted]:
            req.output_ids.append(token)
            req.check_finished()
            if req.finished():
                break
        req.kv_committed_len += accepted
    batch.seq_lens = new_seq_lens
    batch.seq_lens_cpu = new_seq_lens.cpu()
    batch.spec_info = next_input
    batch.output_ids = result.next_token_ids
    step["reqs"] = _snapshot_reqs(batch)
    step["emitted"] = {r.rid: list(r.output_ids)[before["outputs"][r.rid]:] for r in batch.reqs}
    # The real v2 scheduler holds the draft input behind FutureMap indices: filter_batch
    # selects those (0.5.5: and allocate_lens) by index, and the next step resolves the
    # tensors through them. Do the same with identity indices.
    n = len(step["accept_lens"])
    next_input.future_indices = SimpleNamespace(indices=torch.arange(n))
    world.release_finished(batch)
    world.call(batch.filter_batch)
    kept = next_input.future_indices.indices
    next_input.future_indices = None
    batch.spec_info = world.select_rows(next_input, kept.tolist(), n)
    step["rids_after_filter"] = [r.rid for r in batch.reqs]
    step["free_after_release"] = allocator.available_size()
    step["live_allocated"] = sum(r.kv_allocated_len for r in batch.reqs)
    step["release_kv_cache"] = hasattr(sys.modules.get("sglang.srt.mem_cache.common"),
                                       "release_kv_cache")
    return step


GRAPH_BS = [1, 2, 4]  # draft-extend graph sizes with graphs=True: a batch of 3 pads to 4


@contextlib.contextmanager
def _draft_extend_graphs(release: Any, worker: Any, on: bool) -> Any:
    """With ``on``: the draft worker replays draft-extend "graphs" (harness/
    cpu_graphs.py), so the runtime captures and uses its width-1 ones."""
    if not on:
        yield None
        return
    saved = cpu_graphs.install(release, worker, GRAPH_BS)
    try:
        yield saved
    finally:
        cpu_graphs.uninstall(release, saved)


def _graph_report(release: Any, worker: Any, installed: dict[str, Any]) -> dict[str, Any]:
    """What the runtime made of the graphs, every replay of them, and its log lines."""
    adapter = release.fallback_mod._adapters.get(release.worker_cls)
    decode = getattr(adapter, "decode_graphs", None)
    width1 = getattr(adapter, "draft_extend_width1", None)
    n_token = worker.draft_worker.cuda_graph_runner_for_draft_extend
    report: dict[str, Any] = {
        "note": getattr(adapter, "draft_extend_width1_note", None),
        "n_token_width": cpu_graphs.captured_width(n_token) if n_token else None,
        "n_token_replays": list(getattr(n_token, "replayed", [])),
        "width1": None,
        "decode": None,
        "clamp_position_calls": installed["clamp_calls"],
        "log": list(_LOG_LINES),
    }
    if decode is not None:
        runner = decode.runner
        report["decode"] = {
            "batch_sizes": decode.batch_sizes,
            "num_tokens_per_bs": runner.num_tokens_per_bs,
            "capture_forward_mode": runner.capture_forward_mode.name,
            "capture_hidden_mode": runner.capture_hidden_mode.name,
            "captures": runner.captures,
            "backend": decode.attn_backend.label,
            "replays": runner.replayed,
        }
    if width1 is not None:
        backend = width1.attn_backend
        report["width1"] = {
            "captured_width": cpu_graphs.captured_width(width1.runner),
            "batch_sizes": width1.batch_sizes,
            "backend_widths": [backend.speculative_num_steps, backend.num_draft_tokens],
            "backend_is_new": backend is not worker.draft_worker.draft_extend_attn_backend,
            "cuda_graph_state": list(backend.cuda_graph_state),
            "replays": list(width1.runner.replayed),
            "broken": width1.broken,
        }
    return report


def check_v2_steps(steps: int, graphs: bool = False) -> dict[str, Any]:
    """v2: the scheduler's prepare_for_decode + get_model_worker_batch, the patched
    EAGLEWorkerV2 entry, then the output processing the scheduler does with its result."""
    release = world.import_release("v2")
    args = world.server_args(threshold=1)
    req_to_token_pool, allocator = world.memory()
    total = allocator.available_size()
    specs = [
        world.RequestSpec(prompt=[3, 5, 7, 11, 13], first_token=11, max_new_tokens=3),
        world.RequestSpec(prompt=list(range(20, 29)), first_token=22, max_new_tokens=30),
        world.RequestSpec(prompt=list(range(60, 66)), first_token=44, max_new_tokens=5),
    ][: 3 if graphs else 2]
    batch = world.v2_decode_batch(release, args, specs, req_to_token_pool, allocator)
    batch_ref = [batch]
    worker = world.v2_worker(release, args, req_to_token_pool, allocator, batch_ref)
    report: dict[str, Any] = {"total_slots": total, "steps": []}
    with _draft_extend_graphs(release, worker, graphs) as installed:
        for _ in range(steps):
            report["steps"].append(_v2_run_step(release, worker, batch, batch_ref, allocator))
            if not batch.reqs:
                break
        if installed is not None:
            report["graphs"] = _graph_report(release, worker, installed)
    return report


def check_v2_cycle(max_steps: int = 100, graphs: bool = False) -> dict[str, Any]:
    """v2 at T=2: r2 speculates alone through EAGLEWorkerV2's REAL speculative path; r0 and r1
    join (merge_batch), the batch of 3 runs fallback steps; then r2 speculates again."""
    release = world.import_release("v2")
    args = world.server_args(threshold=2)
    req_to_token_pool, allocator = world.memory()
    total = allocator.available_size()
    batch = world.v2_decode_batch(release, args, [world.RequestSpec(
        prompt=list(range(40, 52)), first_token=33, max_new_tokens=120)], req_to_token_pool,
        allocator, rids=["r2"])
    batch_ref = [batch]
    worker = world.v2_worker(release, args, req_to_token_pool, allocator, batch_ref)
    joining = [
        world.RequestSpec(prompt=[3, 5, 7, 11, 13], first_token=11, max_new_tokens=30),
        world.RequestSpec(prompt=list(range(20, 29)), first_token=22, max_new_tokens=34),
    ]
    steps = []
    with _draft_extend_graphs(release, worker, graphs) as installed:
        for i in range(max_steps):
            if not batch.reqs:
                break
            if i == 3:
                newcomers = world.v2_decode_batch(release, args, joining, req_to_token_pool,
                                                  allocator, rids=["r0", "r1"])
                lens = [getattr(b.spec_info, "allocate_lens", None) for b in (batch, newcomers)]
                batch.merge_batch(newcomers)
                if lens[0] is not None:  # 0.5.5: a future-indexed merge concatenates these
                    batch.spec_info.allocate_lens = torch.cat(lens)
            steps.append(_v2_run_step(release, worker, batch, batch_ref, allocator))
            steps[-1]["free_plus_allocated"] = (steps[-1]["free_after_release"]
                                                + steps[-1]["live_allocated"])
        graph_report = _graph_report(release, worker, installed) if installed else None
    controller = release.fallback_mod._adapters[release.worker_cls].controller
    outputs: dict[str, list[int]] = {}
    for step in steps:
        for rid, tokens in step["emitted"].items():
            outputs.setdefault(rid, []).extend(tokens)
    return {
        "total_slots": total,
        "num_steps": args.speculative_num_steps,
        "first_tokens": {"r2": 33, "r0": 11, "r1": 22},
        "max_new_tokens": {"r2": 120, "r0": 30, "r1": 34},
        "steps": [{k: step[k] for k in ("mode", "before", "emitted", "accept_lens",
                                        "free_plus_allocated", "stride", "draft_calls")}
                  for step in steps],
        "graphs": graph_report,
        "emitted_by_rid": outputs,
        "controller": {"fallback_steps": controller.n_fallback_steps,
                       "spec_steps": controller.n_spec_steps,
                       "switches": controller.n_switches,
                       "min_dwell_steps": controller.min_dwell_steps},
    }


def check_cycle(max_steps: int = 100) -> dict[str, Any]:
    """v1 at T=2 (resume at bs <= 1), through the REAL speculative path on both sides:
    r2 speculates alone; r0 and r1 join (the scheduler's merge_batch), so after the dwell the
    batch of 3 runs fallback steps; once r0 and r1 have finished and r2 has run 32 steps alone,
    r2 speculates again from the draft state the fallback steps left."""
    release = world.import_release("v1")
    args = world.server_args(threshold=2)
    req_to_token_pool, allocator = world.memory()
    total = allocator.available_size()
    alone = [world.RequestSpec(prompt=list(range(40, 52)), first_token=33, max_new_tokens=120)]
    joining = [
        world.RequestSpec(prompt=[3, 5, 7, 11, 13], first_token=11, max_new_tokens=30),
        world.RequestSpec(prompt=list(range(20, 29)), first_token=22, max_new_tokens=34),
    ]
    batch = world.prefilled_batch(release, args, alone, req_to_token_pool, allocator,
                                  rids=["r2"])
    batch_ref = [batch]
    worker = world.v1_worker(release, args, req_to_token_pool, allocator, batch_ref)
    entry = getattr(release.worker_cls, entry_name(release))
    steps = []
    for i in range(max_steps):
        if not batch.reqs:
            break
        if i == 3:  # new requests arrive: their prefill done, the scheduler merges them in
            newcomers = world.prefilled_batch(release, args, joining, req_to_token_pool,
                                              allocator, rids=["r0", "r1"])
            batch.merge_batch(newcomers)
        n_target = len(worker.target_worker.calls)
        before = {"rids": [r.rid for r in batch.reqs], "root": _root_of(batch.spec_info),
                  "outputs": {r.rid: len(r.output_ids) for r in batch.reqs}}
        with CudaAsCpu():
            result = entry(worker, batch)
        calls = worker.target_worker.calls[n_target:]
        steps.append({
            "before": before,
            "mode": calls[0].forward_mode if calls else None,
            "emitted": {r.rid: list(r.output_ids)[before["outputs"][r.rid]:]
                        for r in batch.reqs},
            "result": _result_summary(result),
        })
        world.release_finished(batch)
        world.call(batch.filter_batch, v1_spec_info_filtered=True)
        steps[-1]["free_plus_live"] = allocator.available_size() + (
            sum(batch.seq_lens.tolist()) if batch.reqs else 0)
    controller = release.fallback_mod._adapters[release.worker_cls].controller
    outputs: dict[str, list[int]] = {}
    for step in steps:
        for rid, tokens in step["emitted"].items():
            outputs.setdefault(rid, []).extend(tokens)
    return {
        "total_slots": total,
        "num_steps": args.speculative_num_steps,
        "first_tokens": {"r2": 33, "r0": 11, "r1": 22},
        "max_new_tokens": {"r2": 120, "r0": 30, "r1": 34},
        "steps": steps,
        "emitted_by_rid": outputs,
        "controller": {"fallback_steps": controller.n_fallback_steps,
                       "spec_steps": controller.n_spec_steps,
                       "switches": controller.n_switches,
                       "min_dwell_steps": controller.min_dwell_steps},
    }


_LOG_LINES: list[str] = []  # the runtime's log lines of the part that runs


class _LogLines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _LOG_LINES.append(record.getMessage())


CHECKS = ("wiring", "steps", "at_threshold", "cycle", "steps_graphs", "cycle_graphs", "all")


def run(check: str, variant: str, steps: int, threshold: int) -> dict[str, Any]:
    if check == "wiring":
        return check_wiring(variant)
    if check == "steps":
        return check_steps(variant, steps, threshold) if variant == "v1" else check_v2_steps(
            steps)
    if check == "at_threshold":
        return check_at_threshold(variant)
    if check == "cycle":
        return check_cycle() if variant == "v1" else check_v2_cycle()
    if check == "steps_graphs":
        return check_v2_steps(steps, graphs=True)
    if check == "cycle_graphs":
        return check_v2_cycle(graphs=True)
    # all: one interpreter per (release, worker) keeps the tier's run time down; each part
    # reports its own failure so that one broken part does not hide the others.
    parts: dict[str, Any] = {"wiring": lambda: check_wiring(variant)}
    parts["at_threshold"] = lambda: check_at_threshold(variant)
    if variant == "v2":
        parts["steps"] = lambda: check_v2_steps(steps)
        parts["cycle"] = check_v2_cycle
        parts["steps_graphs"] = lambda: check_v2_steps(steps, graphs=True)
        parts["cycle_graphs"] = lambda: check_v2_cycle(graphs=True)
    else:
        parts["steps"] = lambda: check_steps(variant, steps, threshold)
        parts["cycle"] = check_cycle
    report = {}
    for name, part in parts.items():
        world.import_release(variant).fallback_mod.reset_for_tests()  # a fresh "server"
        _LOG_LINES.clear()
        report[name] = _guarded(part)
    return report


def _guarded(part: Any) -> dict[str, Any]:
    try:
        return {"ok": True, **part()}
    except Exception as exc:  # reported to the pytest side, which fails that test
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()}


def main() -> int:
    runtime_log = logging.getLogger(f"{world.SPEC}.dynspec_fallback")
    runtime_log.addHandler(_LogLines())
    runtime_log.setLevel(logging.INFO)
    parser = argparse.ArgumentParser()
    parser.add_argument("check", choices=CHECKS)
    parser.add_argument("variant", choices=("v1", "v2"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threshold", type=int, default=1)
    ns = parser.parse_args()
    try:
        report = run(ns.check, ns.variant, ns.steps, ns.threshold)
        report["ok"] = True
    except Exception as exc:  # report, do not hide: the pytest side prints this
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    print(json.dumps(report, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
