"""Load a script of ``experiments/`` as a fresh module for a test (the scripts are not a package)."""
import importlib.util
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def load_experiment(name: str):
    """``experiments/<name>.py`` executed as a new module, with ``experiments/`` on ``sys.path`` while it runs
    (scripts import their siblings, e.g. ``bench_decode_attention``)."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod              # dataclasses (and pickling) look the defining module up by name
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(EXPERIMENTS))
    return mod
