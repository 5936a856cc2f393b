# Pre-build the tvm-ffi JIT kernels (SGLang 0.5.12.post1 / 0.5.13.post1 layout) that a Llama
# (+EAGLE-3) server uses, in parallel,
# into $TVM_FFI_CACHE_DIR, so compile errors show early and the server start is faster.
# usage: python3 jitwarm.py [8b|1b]
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

size = "1b" if "1b" in sys.argv else "8b"
head_dim = 128 if size == "8b" else 64
row_bytes = 8 * head_dim * 2  # 8 KV heads x head_dim x bf16
os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", "9.0")
import torch  # noqa: E402  (after the TVM arch default is set)

try:
    from sglang.jit_kernel.activation import _jit_activation_module
    from sglang.jit_kernel.clamp_position import _jit_clamp_position_module
    from sglang.jit_kernel.kvcache import _jit_kvcache_module
    from sglang.jit_kernel.resolve_future_token_ids import _jit_resolve_future_token_ids_module
    from sglang.jit_kernel.rope import _jit_fused_rope_module, _jit_rotary_embedding_module
    from sglang.jit_kernel.utils import get_jit_cuda_arch
except ImportError as e:  # the JIT kernels moved in later releases (0.5.17: sglang.kernels.jit)
    print(
        f"jit warm total 0.0s: skipped, this release lacks the 0.5.12-era JIT modules ({e}); "
        "they build at server start instead"
    )
    sys.exit(0)
print(
    "jit arch:",
    get_jit_cuda_arch().target_name,
    "cache:",
    os.environ.get("TVM_FFI_CACHE_DIR"),
    flush=True,
)
jobs = [
    ("activation bf16", lambda: _jit_activation_module(torch.bfloat16)),
    (f"kvcache row_bytes={row_bytes}", lambda: _jit_kvcache_module(row_bytes)),
    (
        f"fused_rope neox d{head_dim} bf16",
        lambda: _jit_fused_rope_module(True, head_dim, torch.bfloat16),
    ),
    ("rotary_embedding", _jit_rotary_embedding_module),
    ("clamp_position int64", lambda: _jit_clamp_position_module(torch.int64)),
    ("clamp_position int32", lambda: _jit_clamp_position_module(torch.int32)),
    ("resolve_future_token_ids int64", lambda: _jit_resolve_future_token_ids_module(torch.int64)),
    ("resolve_future_token_ids int32", lambda: _jit_resolve_future_token_ids_module(torch.int32)),
]

# JITWARM_SKIP=name,...: leave those kernels (by name prefix) to compile where the server first
# needs them, e.g. clamp_position, which only a fallback step calls: the first server then
# meets it as on a fresh machine.
skipped = [p for p in os.environ.get("JITWARM_SKIP", "").split(",") if p]
jobs = [job for job in jobs if not any(job[0].startswith(p) for p in skipped)]
if skipped:
    print("jit warm skips:", ", ".join(skipped), flush=True)


def one(job):
    n, f = job
    t = time.time()
    try:
        f()
        return f"OK  {n}: {time.time() - t:.1f}s"
    except Exception as e:
        first = next(
            (
                ln.strip()
                for ln in str(e).splitlines()
                if "error" in ln.lower() and "ninja" not in ln
            ),
            "",
        )
        return (
            f"ERR {n}: {time.time() - t:.1f}s {type(e).__name__}: {first[:600]} || {str(e)[-600:]}"
        )


t0 = time.time()
with ThreadPoolExecutor(len(jobs)) as ex:
    res = list(ex.map(one, jobs))
print("\n".join(res))
print(f"jit warm total {time.time() - t0:.1f}s")
sys.exit(0 if all(r.startswith("OK") for r in res) else 1)
