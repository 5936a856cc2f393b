"""Started by every Python process that a test runs under ``tools/mutation.py``.

mutmut learns which tests reach a mutated function from the hits its trampolines record in the
test process; a function that a test reaches only in a process of its own (the CLI run as
``python -m``, ansible-playbook and its forks) would have no test, and its mutants would be
"no tests". In mutmut's stats pass this appends each mutated function such a process runs to
the file named by ``DYNSPEC_MUTATION_HITS``; ``mutation_hits_plugin`` adds them to the test.
"""

import os

if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("DYNSPEC_MUTATION_HITS"):
    try:
        from mutmut.mutation import trampoline
    except ImportError:  # a Python without mutmut (a test's own SGLang venv): nothing mutated
        trampoline = None
    if trampoline is not None:
        _written: set[str] = set()

        def _record_hit(name: str, caller: str | None = None) -> None:
            if name not in _written:
                _written.add(name)
                with open(os.environ["DYNSPEC_MUTATION_HITS"], "a") as hits:
                    hits.write(name + "\n")

        trampoline.record_trampoline_hit = _record_hit
