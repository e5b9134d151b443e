"""How autoshard installs: the extras, the package list, the zoo inside the package."""

import pathlib
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def names(requirements):
    return {r.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
            for r in requirements}


def test_core_needs_only_what_planning_needs():
    assert names(PYPROJECT["project"]["dependencies"]) == {"jax", "numpy", "scipy", "rich",
                                                           "typer"}


def test_jax_range_is_the_tested_one():
    """pyproject admits the JAX releases the suite runs on, from the oldest to the newest
    release line, and the installed JAX is one of them."""

    from autoshard.frontend import jax_compat
    (jax_req,) = [r for r in PYPROJECT["project"]["dependencies"] if r.startswith("jax")]
    oldest, newest = jax_compat.OLDEST, jax_compat.NEWEST
    major, minor = map(int, newest.split("."))
    assert jax_req == f"jax>={oldest},<{major}.{minor + 1}"
    assert jax_compat.version_tuple(oldest) <= jax_compat.JAX_VERSION < (major, minor + 1)


def test_extras():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert extras["cuda"] == ["jax[cuda12]>=0.10.2,<0.13"]
    assert names(extras["zoo"]) == {"flax", "optax"}
    assert names(extras["checkpoint"]) == {"orbax-checkpoint"}
    assert names(extras["viz"]) == {"matplotlib"}
    assert "autoshard[zoo,checkpoint,viz]" in extras["all"][0] or set(extras["all"]) >= {
        "autoshard[zoo]", "autoshard[checkpoint]", "autoshard[viz]"}
    assert any(r.startswith("autoshard[") and "all" in r for r in extras["dev"])
    assert {"pytest", "nbclient", "nbformat", "ipykernel", "hypothesis"} <= names(extras["dev"])


def test_every_package_is_installed_and_no_top_level_models():
    setuptools = PYPROJECT["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "autoshard").rglob("__init__.py")}
    assert on_disk == set(setuptools["packages"]), on_disk ^ set(setuptools["packages"])
    assert "package-dir" not in setuptools
    assert not (ROOT / "models").exists()


def test_zoo_imports_from_the_package():
    import autoshard.zoo.models.gpt as gpt
    from autoshard.zoo import models
    assert pathlib.Path(models.__file__).parent == ROOT / "autoshard" / "zoo" / "models"
    assert gpt.GPTConfig is models.get("gpt").module.GPTConfig


def test_missing_extra_names_it(monkeypatch):
    from autoshard.extras import MissingExtraError, require
    with pytest.raises(MissingExtraError, match=r'pip install "autoshard\[viz\]"'):
        require("no_such_module_xyz", "viz", "autoshard.report.viz plots")
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)   # as if orbax were missing
    monkeypatch.delitem(sys.modules, "autoshard.runtime.checkpoint", raising=False)
    with pytest.raises(ImportError, match=r'autoshard.runtime.checkpoint needs orbax.checkpoint: '
                                          r'pip install "autoshard\[checkpoint\]"'):
        import autoshard.runtime.checkpoint  # noqa: F401


def test_gpu_target_configs_ship_as_package_data():
    """``autoshard.target_mesh`` reads a target config per GPU kind from the package."""
    from autoshard.target import deviceless
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["autoshard.target"]
    shipped = [p for g in globs for p in (ROOT / "autoshard" / "target").glob(g)]
    assert {p.stem for p in shipped} == set(deviceless.target_kinds()) >= {"h100", "h200", "a100"}
