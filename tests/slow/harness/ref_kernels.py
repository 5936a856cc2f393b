"""Small CPU reference implementations of the CUDA / Triton kernels a fallback step reaches.

Each one reproduces the kernel's semantics for the arguments SGLang passes, with the dtype
checks of the real kernel where a wrong dtype would be a real bug (sgl-kernel's
``verify_tree_greedy`` takes int64 candidates / tree arrays and int32 outputs). They are written
for clarity, not speed: loops over the batch.

``install()`` swaps them in for the originals wherever a loaded ``sglang`` module holds them
(module globals, by identity), and for the ``sgl_kernel`` stand-in's attributes, so that code
which imported a kernel by name and code which imports it at call time both get the reference.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


class NamedGridKernel:
    """A Triton kernel whose parameters changed between releases: bind the call's positional
    arguments to the ORIGINAL kernel's parameter names, and call ``fn(grid, **named)``."""

    def __init__(self, fn: Callable[..., None], arg_names: list[str]) -> None:
        self.fn = fn
        self.arg_names = list(arg_names)
        self.__name__ = fn.__name__

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        grid = grid if isinstance(grid, tuple) else (grid,)

        def launch(*args: Any, **kwargs: Any) -> None:
            named = dict(zip(self.arg_names, args, strict=False))
            named.update(kwargs)
            self.fn(grid, **named)

        return launch


class GridKernel:
    """Mimics a Triton kernel object: ``kernel[grid](*args)`` calls ``fn(grid, *args)``."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        grid = grid if isinstance(grid, tuple) else (grid,)
        return lambda *args, **kwargs: self.fn(grid, *args, **kwargs)


def _require_dtype(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in dtypes:
        raise TypeError(f"verify_tree_greedy: {name} must be {dtypes}, got {tensor.dtype}")


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    *_: Any,
    **__: Any,
) -> None:
    """sgl-kernel VerifyTreeGreedy: walk each tree, accept drafts equal to the target argmax.

    Index inputs: sgl-kernel 0.1.x took int32 (0.4.6.post5 casts them), later builds int64
    (later releases pass them uncast). Either way all five share one dtype; an int32 tree root
    next to int64 tree arrays is the bug the real kernel rejects.
    """
    index_dtype = candidates.dtype
    _require_dtype("candidates", candidates, (torch.int32, torch.int64))
    for name, tensor in (
        ("candidates", candidates),
        ("retrive_index", retrive_index),
        ("retrive_next_token", retrive_next_token),
        ("retrive_next_sibling", retrive_next_sibling),
        ("target_predict", target_predict),
    ):
        _require_dtype(name, tensor, (index_dtype,))
    for name, tensor in (
        ("predicts", predicts),
        ("accept_index", accept_index),
        ("accept_token_num", accept_token_num),
    ):
        _require_dtype(name, tensor, (torch.int32,))
    bs = candidates.shape[0]
    num_spec = accept_index.shape[1]
    flat_target = target_predict.reshape(-1)  # indexed by the global retrive_index values
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted = 0
        cur = 0
        for _ in range(1, num_spec):
            cur = int(retrive_next_token[b, cur])
            while cur != -1:
                draft_index = int(retrive_index[b, cur])
                target = int(flat_target[last])
                if int(candidates[b, cur]) == target:
                    predicts[last] = target
                    accepted += 1
                    accept_index[b, accepted] = draft_index
                    last = draft_index
                    break
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
        accept_token_num[b] = accepted
        predicts[last] = flat_target[last]


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    *_: Any,
    **__: Any,
) -> None:
    """One-node trees only: accept the root, sample the bonus token from relu(q - p)."""
    if candidates.shape[1] != 1:
        raise NotImplementedError("the CPU reference covers one-node trees only")
    for b in range(candidates.shape[0]):
        root = int(retrive_index[b, 0])
        accept_index[b, 0] = root
        accept_token_num[b] = 0
        residual = (target_probs[b, 0] - draft_probs[b, 0]).clamp_min(0)
        cdf = torch.cumsum(residual, 0)
        coin = float(uniform_samples_for_final_sampling[b]) * float(cdf[-1])
        predicts[root] = int(torch.searchsorted(cdf, torch.tensor([coin], dtype=cdf.dtype)))


def top_k_renorm_prob(probs: torch.Tensor, top_ks: torch.Tensor, *_: Any, **__: Any) -> Any:
    out = torch.zeros_like(probs)
    for row in range(probs.shape[0]):
        k = min(int(top_ks.reshape(-1)[row]), probs.shape[-1])
        values, index = probs[row].topk(k)
        out[row, index] = values / values.sum()
    return out


def top_p_renorm_prob(probs: torch.Tensor, top_ps: torch.Tensor, *_: Any, **__: Any) -> Any:
    out = torch.zeros_like(probs)
    for row in range(probs.shape[0]):
        values, index = probs[row].sort(descending=True)
        keep = (values.cumsum(0) - values) < float(top_ps.reshape(-1)[row])
        out[row, index[keep]] = values[keep] / values[keep].sum()
    return out


def fast_topk(values: torch.Tensor, topk: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if topk == 1:
        return torch.max(values, dim=dim, keepdim=True)
    return torch.topk(values, topk, dim=dim)


def _assign_req_to_token_pool(
    grid: tuple[int, ...],
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *_: Any,
) -> None:
    """req_to_token[pool[i], start[i]:end[i]] = the next (end - start) out_cache_loc entries."""
    taken = 0
    for i in range(grid[0]):
        start, end = int(start_offset[i]), int(end_offset[i])
        row = int(req_pool_indices[i])
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start].to(
            req_to_token.dtype
        )
        taken += end - start


def _write_req_to_token_pool(
    grid: tuple[int, ...],
    req_to_token_ptr: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_tensors: torch.Tensor,
    pre_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token_ptr_stride: int | None = None,
) -> None:
    """``write_req_to_token_pool_triton`` (0.5.3.post1+; 0.4.x's has no ``prefix_tensors``):
    request i's row takes its prefix's slots (read from the int64 tensor at the address
    ``prefix_tensors[i]``, as the kernel does) at 0..pre_len, then the next seq_len - pre_len
    entries of out_cache_loc (request i's start: the sum of the earlier extend_lens)."""
    import ctypes

    del req_to_token_ptr_stride  # the row stride of req_to_token_ptr, which torch knows
    start = 0
    for i in range(grid[0]):
        row, pre_len, seq_len = int(req_pool_indices[i]), int(pre_lens[i]), int(seq_lens[i])
        if pre_len:
            address = int(prefix_tensors[i])
            prefix = (ctypes.c_int64 * pre_len).from_address(address)
            req_to_token_ptr[row, :pre_len] = torch.tensor(
                list(prefix), dtype=req_to_token_ptr.dtype
            )
        new = seq_len - pre_len
        req_to_token_ptr[row, pre_len:seq_len] = out_cache_loc[start : start + new].to(
            req_to_token_ptr.dtype
        )
        start += int(extend_lens[i])


def _create_extend_after_decode_spec_info(
    grid: tuple[int, ...],
    verified_id: torch.Tensor,
    seq_lens: torch.Tensor,
    accept_lens: torch.Tensor,
    positions: torch.Tensor,
    new_verified_id: torch.Tensor,
    *_: Any,
) -> None:
    """Positions L-a .. L-1 per request; new verified id = its last accepted token."""
    offset = 0
    for i in range(grid[0]):
        length, accepted = int(seq_lens[i]), int(accept_lens[i])
        positions[offset : offset + accepted] = torch.arange(length - accepted, length)
        new_verified_id[i] = verified_id[offset + accepted - 1]
        offset += accepted


def _create_extend_spec_info(
    grid: tuple[int, ...],
    verified_id: torch.Tensor,
    seq_lens: torch.Tensor,
    accept_lens: torch.Tensor,
    accept_len_cum: torch.Tensor,
    positions: torch.Tensor,
    new_verified_id: torch.Tensor,
    *_: Any,
) -> None:
    """0.4.6's name for the same kernel, with the cumulative accept lengths passed in."""
    for i in range(grid[0]):
        offset = 0 if i == 0 else int(accept_len_cum[i - 1])
        length, accepted = int(seq_lens[i]), int(accept_lens[i])
        positions[offset : offset + accepted] = torch.arange(length - accepted, length)
        new_verified_id[i] = verified_id[int(accept_len_cum[i]) - 1]


def _compute_position_kernel(
    grid: tuple[int, ...],
    positions: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    has_prefix: bool,
    *_: Any,
) -> None:
    """Extend positions prefix..prefix+len-1 per request (prefix 0 when has_prefix is False)."""
    start = 0
    for i in range(grid[0]):
        prefix = int(extend_prefix_lens[i]) if has_prefix else 0
        length = int(extend_seq_lens[i])
        positions[start : start + length] = torch.arange(prefix, prefix + length)
        extend_start_loc[i] = start
        start += length


def _assign_draft_cache_locs(grid: tuple[int, ...], **a: Any) -> None:
    """Page size 1 or topk 1: req_to_token[pool[i], L_i : L_i + topk*steps] = that request's
    topk*steps entries of out_cache_loc (the draft's temporary slots)."""
    if int(a.get("page_size", 1)) != 1 and int(a["topk"]) != 1:
        raise NotImplementedError("the CPU reference covers page_size 1 or topk 1")
    span = int(a["topk"]) * int(a["speculative_num_steps"])
    for i in range(grid[0]):
        start = int(a["seq_lens"][i])
        row = int(a["req_pool_indices"][i])
        a["req_to_token"][row, start : start + span] = a["out_cache_loc"][
            i * span : (i + 1) * span].to(a["req_to_token"].dtype)


def _assign_extend_cache_locs(grid: tuple[int, ...], **a: Any) -> None:
    """out_cache_loc = concat over requests of req_to_token[pool[i], start[i]:end[i]]."""
    taken = 0
    for i in range(grid[0]):
        start, end = int(a["start_offset"][i]), int(a["end_offset"][i])
        row = int(a["req_pool_indices"][i])
        a["out_cache_loc"][taken : taken + end - start] = a["req_to_token"][row, start:end]
        taken += end - start


def _fill_new_verified_id(grid: tuple[int, ...], **a: Any) -> None:
    """new_verified_id[i] = verified_id[N*i + accept_lens[i] - 1] (the last accepted token)."""
    n = int(a["num_draft_tokens"])
    flat = a["verified_id"].reshape(-1)  # Triton reads it as flat memory: (bs, N) row-major
    for i in range(grid[0]):
        a["new_verified_id"][i] = flat[n * i + int(a["accept_lens"][i]) - 1]


def _fill_bonus_tokens(grid: tuple[int, ...], **a: Any) -> None:
    """0.5.12.post1's name for fill_new_verified_id (accept_tokens -> bonus_tokens_ptr)."""
    _fill_new_verified_id(grid, verified_id=a["accept_tokens"], accept_lens=a["accept_lens"],
                          new_verified_id=a["bonus_tokens_ptr"],
                          num_draft_tokens=a["num_draft_tokens"])


def build_tree_kernel_efficient(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    *_: Any,
) -> None:
    """sgl-kernel build_tree_kernel_efficient for topk = 1: each tree is a chain
    root -> d1 -> ... ; node j sits at depth j. The mask is left all-True as allocated (it
    only feeds the attention kernels, which do not run here)."""
    if topk != 1:
        raise NotImplementedError("the CPU reference covers topk = 1 (chains) only")
    for b in range(verified_seq_len.shape[0]):
        length = int(verified_seq_len[b])
        for j in range(draft_token_num):
            positions[b * draft_token_num + j] = length + j
            retrive_index[b, j] = b * draft_token_num + j
            retrive_next_token[b, j] = j + 1 if j + 1 < draft_token_num else -1
            retrive_next_sibling[b, j] = -1


assign_req_to_token_pool = GridKernel(_assign_req_to_token_pool)
compute_position_kernel = GridKernel(_compute_position_kernel)
create_extend_spec_info = GridKernel(_create_extend_spec_info)
create_extend_after_decode_spec_info = GridKernel(_create_extend_after_decode_spec_info)

# Triton kernels: looked up by name in these SGLang modules, replaced everywhere by identity.
TRITON_KERNELS: dict[str, GridKernel] = {
    "assign_req_to_token_pool": assign_req_to_token_pool,
    "create_extend_after_decode_spec_info": create_extend_after_decode_spec_info,
    "compute_position_kernel": compute_position_kernel,
    "create_extend_spec_info": create_extend_spec_info,
}
TRITON_HOMES = (
    "sglang.srt.speculative.spec_utils",
    "sglang.srt.speculative.eagle_info_v2",
    "sglang.srt.speculative.eagle_utils",
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.kernels.ops.memory.common",
    "sglang.srt.mem_cache.triton_ops.common",
    "sglang.srt.mem_cache.common",
    "sglang.srt.managers.schedule_batch",
)

# sgl_kernel functions: set on the stand-in module and replaced wherever imported by name.
SGL_KERNEL_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "verify_tree_greedy": verify_tree_greedy,
    "tree_speculative_sampling_target_only": tree_speculative_sampling_target_only,
    "top_k_renorm_prob": top_k_renorm_prob,
    "top_p_renorm_prob": top_p_renorm_prob,
    "fast_topk": fast_topk,
    "build_tree_kernel_efficient": build_tree_kernel_efficient,
}

# Triton kernels whose parameter list drifted: bound by the original's parameter names.
NAMED_TRITON_KERNELS: dict[str, Callable[..., None]] = {
    "assign_draft_cache_locs": _assign_draft_cache_locs,
    "assign_draft_cache_locs_page_size_1": _assign_draft_cache_locs,
    "assign_extend_cache_locs": _assign_extend_cache_locs,
    "fill_new_verified_id": _fill_new_verified_id,
    "fill_bonus_tokens": _fill_bonus_tokens,
    # bound by the release's own parameter names, which the runtime's warm-up checks
    "write_req_to_token_pool_triton": _write_req_to_token_pool,
}


def _replace_everywhere(original: Any, replacement: Any) -> list[str]:
    replaced = []
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("sglang") or module is None:
            continue
        namespace = vars(module)
        for key, value in list(namespace.items()):
            if value is original:
                namespace[key] = replacement
                replaced.append(f"{mod_name}.{key}")
    return replaced


def install() -> dict[str, list[str]]:
    """Swap every reference kernel in; return where each one landed (for the report)."""
    placed: dict[str, list[str]] = {}
    for name, kernel in TRITON_KERNELS.items():
        for home in TRITON_HOMES:
            original = getattr(sys.modules.get(home), name, None)
            if original is not None and original is not kernel:
                placed.setdefault(name, []).extend(_replace_everywhere(original, kernel))
    for name, fn in NAMED_TRITON_KERNELS.items():
        for home in TRITON_HOMES:
            original = getattr(sys.modules.get(home), name, None)
            if original is not None and not isinstance(original, NamedGridKernel):
                kernel = NamedGridKernel(fn, original.arg_names)
                placed.setdefault(name, []).extend(_replace_everywhere(original, kernel))
    stubs = [m for n, m in list(sys.modules.items())
             if m is not None and (n == "sgl_kernel" or n.startswith("sgl_kernel."))]
    for stub in stubs:  # the package and submodules such as sgl_kernel.top_k
        for name, fn in SGL_KERNEL_FUNCTIONS.items():
            original = vars(stub).get(name)
            if original is not None and original is not fn:
                placed.setdefault(name, []).extend(_replace_everywhere(original, fn))
            if stub.__name__ == "sgl_kernel" or original is not None:
                setattr(stub, name, fn)  # for `from sgl_kernel import x` inside a function
    return placed
