"""The module dynspec-patch installs into SGLang as ``sglang/srt/speculative/dynspec_fallback.py``."""
