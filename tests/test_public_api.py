"""The top-level API: every export is what its docs say, whatever was imported before."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import torchpipedream as tpd

HERE = Path(__file__).resolve().parent


def test_every_export_is_called_after_every_submodule_was_imported() -> None:
    result = subprocess.run([sys.executable, str(HERE / "public_api_calls.py")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    called = set(result.stdout.split("CALLED", 1)[1].split())
    assert called == set(tpd.__all__) - {"__version__"}


def test_the_reported_order_plan_after_plan_class() -> None:
    # `tpd.Plan` first used to import the module `plan`, which then shadowed the function.
    code = ("import torchpipedream as tpd\n"
            "tpd.Plan\n"
            "p = tpd.plan(tpd.load_profile('alexnet'), tpd.Topology.parse('2:10GB/s'))\n"
            "tpd.SimResult\n"
            "r = tpd.simulate(tpd.build_schedule(p, minibatches=4))\n"
            "print(type(p).__name__, type(r).__name__)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["Plan", "SimResult"]


def test_no_submodule_is_named_like_its_packages_exports() -> None:
    packages = [tpd] + [importlib.import_module(i.name) for i in pkgutil.walk_packages(tpd.__path__, "torchpipedream.")
                        if i.ispkg]
    for package in packages:
        children = {info.name for info in pkgutil.iter_modules(package.__path__)}
        clash = children & set(getattr(package, "__all__", ()))
        assert not clash, f"{package.__name__}: submodules named like its exports: {sorted(clash)}"


def test_the_pipeline_docstring_example_runs() -> None:
    module = importlib.import_module("torchpipedream.runtime.pipeline")
    failed, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert attempted > 0 and failed == 0
