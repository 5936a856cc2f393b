# Kit workaround, used ONLY when SGLang 0.5.12.post1's tvm-ffi JIT build of
# elementwise/activation.cuh
# fails on this host (seen with nvcc 13.0.88 + g++ 12.2: "type/value mismatch ...
# activation_kernel").
# Then silu_and_mul (jit) is replaced by sgl_kernel's prebuilt silu_and_mul (common_ops, same math),
# for pristine and patched runs alike.  Active only with KIT_ACT_FALLBACK=1 (run.sh sets it).
import os
import sys

if os.environ.get("KIT_ACT_FALLBACK") == "1":
    import importlib.abc
    import importlib.machinery

    class _KitActFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "sglang.jit_kernel.activation":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            orig = spec.loader.exec_module

            def exec_module(module, _orig=orig):
                _orig(module)
                _jit = module.silu_and_mul

                def silu_and_mul(input, out=None, expert_ids=None, expert_step=1):
                    if expert_ids is not None:
                        return _jit(input, out, expert_ids, expert_step)
                    import sgl_kernel

                    return sgl_kernel.silu_and_mul(input, out)

                module.silu_and_mul = silu_and_mul
                print(
                    "[kit] silu_and_mul -> sgl_kernel.silu_and_mul (JIT activation fallback)",
                    file=sys.stderr,
                )

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _KitActFinder())
