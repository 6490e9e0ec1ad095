"""``python -m lbannpy.bench data --summary``: a training run's I/O wait share against the 2 % target."""
from __future__ import annotations

import json

from lbannpy.bench import data


def write(path, frac, wait=0.004, step=0.2, steps=5):
    path.write_text(json.dumps({"steps": steps, "io_wait_fraction": frac, "io_wait_s": wait,
                                "median_step_s": step}))
    return str(path)


def test_summary_verdicts_against_two_percent(tmp_path, capsys):
    under = write(tmp_path / "a.json", 0.0199)
    over = write(tmp_path / "b.json", 0.0201)
    assert data.main(["--summary", under, over]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert out[0].startswith(under) and out[0].endswith("(target <= 2%: met)") and "1.99 %" in out[0]
    assert out[1].startswith(over) and out[1].endswith("(target <= 2%: NOT met)") and "2.01 %" in out[1]
    assert "median step 200.0 ms" in out[0] and "median io_wait 4.00 ms" in out[0]


def test_summary_without_figures_says_so_and_fails(tmp_path, capsys):
    empty = write(tmp_path / "c.json", None, None, None, 0)
    assert data.main(["--summary", empty, str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("no I/O wait figures" in line for line in err)
