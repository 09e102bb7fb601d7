"""A script run as ``python benchmarks/X.py`` puts ``benchmarks/`` first on ``sys.path``, so a
script named like an installed package shadows it for every import in that process (transformers
5.25 looks for the ``kernels`` package: ``benchmarks/kernels.py`` broke ``benchmarks/hf_models.py``
on a fresh install). No benchmark script may share a top-level name with an installed module."""
import pathlib
import pkgutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_benchmark_script_shadows_an_installed_module():
    bench = ROOT / "benchmarks"
    paths = [p for p in sys.path if pathlib.Path(p or ".").resolve() not in (bench, bench / "gpu")]
    installed = {m.name for m in pkgutil.iter_modules(paths)} | set(sys.builtin_module_names)
    scripts = {p.stem for d in (bench, bench / "gpu") for p in d.glob("*.py")}
    assert scripts, "no benchmark scripts found"
    assert not scripts & installed, f"benchmark scripts shadowing installed modules: {sorted(scripts & installed)}"
