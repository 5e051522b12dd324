"""pytest-gpuhost: verify GPU hosts and repair them as they go.

PYTEST_DONT_REWRITE: this package's own module holds no assert to rewrite. pytest marks the
plugin's top package for assertion rewriting once per run; a run started inside a session that
has already imported the package (pytester's in-process `runpytest`, under the `pytest` script and
an editable install, whose import finder pytest's rewriter cannot see through) would otherwise
warn that it "cannot be rewritten". The plugin's modules below are marked and rewritten as before.
"""

from __future__ import annotations

__version__ = "0.1.0"
