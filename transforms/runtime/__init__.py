"""The module dynspec-patch installs as ``sglang/srt/speculative/dynspec_fallback.py``."""
