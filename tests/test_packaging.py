"""The wheel holds exactly one top-level package, and the folder mapping imports."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("draft", "verify", "kernels", "cluster")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True,
    )  # fmt: skip
    (whl,) = out.glob("specdec-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_has_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"specdec"}
    for sub in SUBPACKAGES:
        assert f"specdec/{sub}/__init__.py" in names
    assert "specdec/kernels/megakernel/__init__.py" in names


@pytest.mark.slow
def test_wheel_imports_from_a_clean_dir(wheel, tmp_path):
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    code = (
        "import specdec.draft, specdec.verify, specdec.kernels, specdec.cluster, sys;"
        "import specdec.kernels.transformer, specdec.verify.tree;"
        "assert specdec.__file__.startswith(sys.argv[1]), specdec.__file__;"
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules"
    )
    env = {"PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code, str(target)], check=True, env=env, cwd=tmp_path)


def test_editable_install_imports():
    """From outside the repo, the folders import only under specdec.*, never bare."""
    code = (
        "import specdec.draft, specdec.verify, specdec.kernels, specdec.cluster, sys;"
        "import specdec.api, importlib.util as u;"
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules;"
        "bare = [n for n in ('draft', 'verify', 'kernels', 'cluster') if u.find_spec(n) and "
        "str(u.find_spec(n).origin).startswith(sys.argv[1])];"
        "assert not bare, bare"
    )
    subprocess.run([sys.executable, "-c", code, str(ROOT)], check=True, cwd="/")
