"""Malformed inputs are refused with a ConfigError that names the key path and the problem.

Each spec in ``tests/data/bad_specs/`` starts with header comments read here:

    # expect-path: model.layers[0].kernel    (ConfigError.path starts with this)
    # expect: must be positive|did you mean   (each '|'-separated phrase occurs in the message, any case)
    # ranks: 6                                (optional: validate against this rank count)

Data files the specs name are written into the test's temporary directory, which is also the base
directory for relative data paths. Broken config.h5 files are generated the same way.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

from lbannpy.config import ConfigError, FORMAT, load_config, read_raw, save_config, validate

CORPUS = Path(__file__).parent / "data" / "bad_specs"


@dataclass(frozen=True)
class BadSpec:
    file: Path
    path: str
    phrases: tuple[str, ...]
    ranks: int | None

    @property
    def id(self) -> str:
        return self.file.stem


def _read_case(file: Path) -> BadSpec:
    head = {}
    for line in file.read_text().splitlines():
        if not line.startswith("# ") or ":" not in line:
            break
        key, _, value = line[2:].partition(":")
        head[key.strip()] = value.strip()
    assert "expect-path" in head and "expect" in head, f"{file.name}: header lacks expect-path/expect"
    return BadSpec(file, head["expect-path"], tuple(p.strip() for p in head["expect"].split("|")),
                   int(head["ranks"]) if "ranks" in head else None)


CASES = [_read_case(f) for f in sorted(CORPUS.glob("*.yaml"))]


def _write_data(d: Path) -> None:
    """The HDF5 files the corpus names: one that fits the corpus model (3×8×8 inputs, 16 samples) and
    variants that are wrong in one way each."""
    rng = np.random.default_rng(0)

    def write(name, x, y, xname="inputs"):
        with h5py.File(d / name, "w") as f:
            f[xname] = x
            f["labels"] = y

    x = rng.standard_normal((16, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    write("good.h5", x, y)
    write("wrong_shape.h5", np.zeros((16, 3, 9, 8), np.float32), y)
    write("wrong_channels.h5", np.zeros((16, 1, 8, 8), np.float32), y)
    write("wrong_ndim.h5", np.zeros((16, 3, 8, 8, 1), np.float32), y)
    write("short_labels.h5", x, y[:15])
    write("float_labels.h5", x, y.astype(np.float32))
    write("string_inputs.h5", np.array([b"a"] * 16 * 3 * 8 * 8).reshape(16, 3, 8, 8), y)
    (d / "not_hdf5.h5").write_bytes(b"this is not an HDF5 file\n" * 4)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    _write_data(d)
    return d


def test_corpus_is_complete():
    """The corpus covers every kind of malformed input the config promises to refuse."""
    names = {c.id for c in CASES}
    for needed in ("bad_yaml_syntax", "wrong_type_filters", "unknown_layer_type", "unknown_key", "cycle",
                   "missing_parent", "zero_filters", "negative_kernel", "duplicate_names",
                   "non_dividing_distribution", "missing_dataset_file", "dataset_wrong_shape",
                   "shape_mismatch_sum"):
        assert needed in names


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_spec_is_refused(case: BadSpec, data_dir: Path):
    spec = data_dir / case.file.name
    shutil.copy(case.file, spec)
    with pytest.raises(ConfigError) as info:
        validate(read_raw(str(spec)), ranks=case.ranks, base_dir=str(data_dir))
    err = info.value
    where = err.path.replace(str(data_dir) + os.sep, "")  # file errors name the file
    assert where.startswith(case.path), f"path {err.path!r}, expected {case.path!r}: {err}"
    text = str(err).lower()
    for phrase in case.phrases:
        assert phrase.lower() in text, f"{phrase!r} not in {str(err)!r}"
    assert err.hint, "every error suggests a fix"


def test_good_data_passes(data_dir: Path):
    """Negative control for the data cases: the same model with good.h5 validates."""
    spec = (CORPUS / "missing_dataset_file.yaml").read_text().replace("missing.h5", "good.h5")
    (data_dir / "ok.yaml").write_text(spec)
    cfg = validate(read_raw(str(data_dir / "ok.yaml")), ranks=4, base_dir=str(data_dir))
    assert cfg["data"]["train"]["path"] == "good.h5"


# --------------------------------------------------------------------------------------------------------
# broken config.h5 files


def _good_h5(d: Path) -> Path:
    p = d / "good_config.h5"
    save_config(read_raw(str(CORPUS / "missing_dataset_file.yaml")), str(p))
    return p


def _truncated(d: Path) -> Path:
    data = _good_h5(d).read_bytes()
    p = d / "truncated.h5"
    p.write_bytes(data[: len(data) // 2])
    return p


def _garbage(d: Path) -> Path:
    p = d / "garbage.h5"
    p.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    return p


def _newer(d: Path) -> Path:
    p = _good_h5(d)
    with h5py.File(p, "r+") as f:
        f.attrs["version"] = np.int64(2)
    return p


def _foreign(d: Path) -> Path:
    p = d / "foreign.h5"
    with h5py.File(p, "w") as f:
        f["inputs"] = np.zeros(3)
    return p


def _dataset_inside(d: Path) -> Path:
    p = _good_h5(d)
    with h5py.File(p, "r+") as f:
        f["trainer"]["weights"] = np.zeros(1000)
    return p


def _huge_attribute(d: Path) -> Path:
    p = _good_h5(d)
    with h5py.File(p, "r+") as f:
        f["trainer"].attrs["seeds"] = np.zeros(5000, np.uint8)
    return p


def _bad_value(d: Path) -> Path:
    p = _good_h5(d)
    with h5py.File(p, "r+") as f:
        f["trainer"].attrs["batch_size"] = np.int64(0)
    return p


def _empty(d: Path) -> Path:
    p = d / "empty.h5"
    p.write_bytes(b"")
    return p


@dataclass(frozen=True)
class BadH5:
    name: str
    make: object
    path_is_file: bool
    phrases: tuple[str, ...]


H5_CASES = [
    BadH5("truncated", _truncated, True, ("truncated",)),
    BadH5("garbage", _garbage, True, ("not an hdf5 file",)),
    BadH5("empty", _empty, True, ("not an hdf5 file",)),
    BadH5("newer_version", _newer, True, ("version 2 is newer",)),
    BadH5("foreign_hdf5", _foreign, True, ("not an lbannpy config", FORMAT)),
    BadH5("dataset_inside", _dataset_inside, False, ("unexpected dataset",)),
    BadH5("huge_attribute", _huge_attribute, False, ("not a config value",)),
    BadH5("invalid_value", _bad_value, False, ("must be positive",)),
]


@pytest.mark.parametrize("case", H5_CASES, ids=[c.name for c in H5_CASES])
def test_bad_config_h5_is_refused(case: BadH5, tmp_path: Path):
    p = case.make(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(str(p))
    err = info.value
    if case.path_is_file:
        assert err.path == str(p)
    else:
        assert err.path.startswith("trainer")
    for phrase in case.phrases:
        assert phrase.lower() in str(err).lower(), str(err)


def test_good_config_h5_loads(tmp_path: Path):
    """Negative control for the h5 cases: the file they start from loads."""
    cfg = load_config(str(_good_h5(tmp_path)))
    assert cfg["trainer"]["batch_size"] == 4


def test_missing_config_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "nope.h5"))


# --------------------------------------------------------------------------------------------------------
# the command line: one line, no traceback, non-zero exit


def _cli(*args, cwd):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "lbannpy.config", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("spec,args,phrase", [
    ("unknown_layer_type.yaml", ["build", "-o", "out.h5"], "model.layers[1].type: unknown layer type"),
    ("non_dividing_distribution.yaml", ["build", "-o", "out.h5", "--ranks", "6"], "parallel.default:"),
    ("missing_dataset_file.yaml", ["validate"], "data.train.path: dataset file"),
], ids=["build-unknown-type", "build-ranks", "validate-missing-data"])
def test_cli_user_error_is_one_line(spec, args, phrase, data_dir: Path):
    shutil.copy(CORPUS / spec, data_dir / spec)
    cmd = [args[0], spec] + args[1:]
    r = _cli(*cmd, cwd=data_dir)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lbannpy.config: error: "), r.stderr
    assert phrase in lines[0] and "(hint: " in lines[0]
    assert "Traceback" not in r.stderr
    assert not (data_dir / "out.h5").exists()  # nothing written on error


def test_an_attribute_with_an_empty_dataspace_is_one_line(tmp_path):
    """h5py.Empty (a null dataspace) where a value belongs: validate and train say which attribute, no
    traceback."""
    import subprocess
    import sys

    import h5py

    from lbannpy.config import save_config, validate

    spec = {"model": {"input": {"channels": 3, "spatial": [8, 8]},
                      "layers": [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3},
                                 {"name": "f1", "type": "fc", "units": 2}]},
            "data": {"train": {"path": str(tmp_path / "d.h5")}}, "trainer": {"batch_size": 2, "steps": 1}}
    path = tmp_path / "c.h5"
    save_config(validate(spec, data=False), str(path))
    with h5py.File(path, "r+") as f:
        f["model/layers/0"].attrs["filters"] = h5py.Empty("i8")
    for cmd in (["lbannpy.config", "validate", str(path)], ["lbannpy.train", str(path), "--quiet"]):
        r = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
        assert r.returncode in (1, 2) and "Traceback" not in r.stderr, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "BLAS/OpenMP" not in ln]
        assert len(lines) == 1 and "model/layers/0/filters: attribute has an empty dataspace" in lines[0], \
            r.stderr
