"""The wheel as a user gets it: built from the package's files alone, installed into a fresh
virtual environment, and run from a directory outside the checkout.

The fresh environment installs the wheel with --no-deps and reaches the dependencies already in
this test's environment through a .pth file holding its site-packages directory as a plain path
line. A plain path line does not run that directory's own .pth files — among them the editable
install's hook that would put the checkout on sys.path — so `nonstop` there can only be the
wheel's copy, which the test asserts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

import nonstop
from nonstop.recipes.config_io import load_config
from nonstop.recipes.rl_recipe import RLRunConfig

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in (REPO / "nonstop" / "recipes" / "configs").glob("*.yaml"))
OPTIONAL = ("psutil", "pyarrow", "sympy", "prometheus-client", "math-verify", "ray", "torch",
            "transformers", "peft")


def run(command: list[str], cwd: Path, timeout: float = 120) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of what the package is made of (not the working tree, so
    that build/ and *.egg-info never land in the checkout)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "nonstop", source / "nonstop",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(root / "dist"), str(source)], cwd=root)
    (built,) = (root / "dist").glob("nonstop-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed."""
    directory = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(directory)], cwd=directory.parent)
    python = directory / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", str(wheel)], cwd=directory.parent)
    site_packages = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                         "['purelib'])"], cwd=directory.parent).strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site_packages, "_test_dependencies.pth").write_text("".join(p + "\n" for p in ours))
    return directory


@pytest.mark.slow
def test_wheel_holds_the_license_the_configs_and_trimmed_requirements(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(f"nonstop-{nonstop.__version__}.dist-info/METADATA").decode()
    assert f"nonstop-{nonstop.__version__}.dist-info/licenses/LICENSE" in names
    assert "nonstop/__main__.py" in names
    assert sorted(Path(n).stem for n in names if n.startswith("nonstop/recipes/configs/")) == \
        SHIPPED
    assert "License-Expression: Apache-2.0" in metadata
    required = [line.split(": ", 1)[1] for line in metadata.splitlines()
                if line.startswith("Requires-Dist: ") and "extra ==" not in line]
    assert not [r for r in required if r.startswith(OPTIONAL)], required
    for extra in ("parquet", "math", "prometheus", "bench", "test"):
        assert f"Provides-Extra: {extra}" in metadata


@pytest.mark.slow
def test_installed_wheel_runs_outside_the_checkout(venv, tmp_path):
    bin_dir = venv / "bin"
    where = run([str(bin_dir / "python"), "-c",
                 "import importlib.util, sys, nonstop; print(nonstop.__file__); "
                 "print(importlib.util.find_spec('nonstop.cli.configs').origin); "
                 "print('\\n'.join(sys.path))"], cwd=tmp_path).splitlines()
    assert Path(where[0]).is_relative_to(venv) and Path(where[1]).is_relative_to(venv), where
    assert str(REPO) not in where[2:] and not any(Path(p) == REPO for p in where[2:] if p), where

    assert run([str(bin_dir / "nonstop"), "--version"], cwd=tmp_path) == \
        f"nonstop {nonstop.__version__}\n"

    listing = run([str(bin_dir / "nonstop"), "configs"], cwd=tmp_path)
    rows = [line.split()[0] for line in listing.splitlines()[1:] if line.strip()]
    assert rows[:len(SHIPPED)] == SHIPPED
    shown = Path(run([str(bin_dir / "nonstop"), "configs", "grpo_arithmetic", "--path"],
                     cwd=tmp_path).strip())
    assert shown.is_relative_to(venv) and shown.read_text() == \
        (REPO / "nonstop/recipes/configs/grpo_arithmetic.yaml").read_text()

    printed = run([str(bin_dir / "nonstop"), "rl", "--print-config", "--config",
                   "grpo_arithmetic", "steps=3"], cwd=tmp_path)
    assert yaml.safe_load(printed)["steps"] == 3
    (tmp_path / "printed.yaml").write_text(printed)
    expected = load_config(RLRunConfig, REPO / "nonstop/recipes/configs/grpo_arithmetic.yaml",
                           ["steps=3"])
    assert load_config(RLRunConfig, tmp_path / "printed.yaml") == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["printed.yaml"]  # nothing built
