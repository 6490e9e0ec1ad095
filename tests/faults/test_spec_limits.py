"""A spec of many megabytes (a generated file gone wrong) is refused before it is parsed, with the limit in
one line, by ``config validate`` and by ``train`` on every rank: parsing it would keep the job busy for
minutes before the same refusal."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from lbannpy import yamlsafe

from . import util


def _big_spec(path, tmp_path) -> None:
    """A valid spec followed by a comment block that takes it over the limit (comments are parsed too)."""
    util.make_data(tmp_path / "data.h5")
    text = yaml.safe_dump(util.spec(tmp_path))
    line = "# " + "x" * 1000 + "\n"
    path.write_text(text + line * (yamlsafe.MAX_BYTES // len(line) + 10))


def test_config_validate_refuses_a_huge_spec_unparsed(tmp_path):
    spec = tmp_path / "big.yaml"
    _big_spec(spec, tmp_path)
    r = subprocess.run([util.PY, "-m", "lbannpy.config", "validate", str(spec)], env=util.ENV,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "big.yaml" in lines[0] and "over the limit of 4 MiB" in lines[0], lines


@pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")
def test_train_refuses_a_huge_spec_on_every_rank(tmp_path):
    spec = tmp_path / "big.yaml"
    _big_spec(spec, tmp_path)
    job = util.Job(tmp_path, 2, subprocess.Popen(
        [util.MPIEXEC, "-n", "2", util.PY, "-m", "lbannpy.train", str(spec), "--quiet"], env=util.ENV,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True),
        util.time.monotonic()).wait(60)
    assert job.proc.returncode == 2, job.err[-2000:]
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "over the limit of 4 MiB" in lines[0], job.err
