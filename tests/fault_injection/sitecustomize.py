"""Imported by Python at the start-up of every process whose path holds this folder (see
``faults.fault_environment``): wraps ``Pipeline`` as soon as its module is imported, so that
the fault in ``TORCHPIPEDREAM_FAULT`` is armed. Not a test module."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

import faults  # now, while this folder is on the path (a spawned child's path is replaced later)

_TARGET = "torchpipedream.runtime.pipeline"


class _WrapPipelineOnImport(importlib.abc.MetaPathFinder):
    """Finds the pipeline module the normal way, then wraps its ``Pipeline`` after it runs."""

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - importlib's protocol
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # let the ordinary finders locate it
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001
            run_module(module)
            faults.wrap_pipeline(module.Pipeline)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TORCHPIPEDREAM_FAULT"):
    sys.meta_path.insert(0, _WrapPipelineOnImport())
