"""A real-GPU check of ``runtime.cuda_graph`` in one process, without MPI (``runtime.backend: single``):

    python tests/gpu/graph_check.py WORKDIR [equal|speed|all]

``equal``: float64, own kernels: the captured run against the eager one (every checkpoint tensor, the logged
losses and gradient norms, the validation metrics), bit for bit, also stopped after 5 steps and resumed;
prints ``EQUALITY PASS`` or ``EQUALITY FAIL`` (exit status 1). ``speed``: a LeNet-5-like net, float32,
batch 32, 200 steps, eager against captured: the median logged step of each (CUDA events). Not collected by
pytest; the GPU tier's ``tests/gpu/test_graph_gpu.py`` runs the same comparisons under ``mpiexec``.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import yaml

W = sys.argv[1]
os.makedirs(W, exist_ok=True)
PY = sys.executable
BN_NET = [
    {"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1, "bias": False},
    {"name": "b1", "type": "batchnorm", "sync": "global"},
    {"name": "r1", "type": "relu"},
    {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
    {"name": "c2", "type": "conv", "filters": 4, "kernel": 3, "stride": 2, "padding": 1},
    {"name": "r2", "type": "relu"},
    {"name": "f1", "type": "fc", "units": 4},
]


def sh(*args, ok=True):
    t = time.time()
    r = subprocess.run([PY, *map(str, args)], capture_output=True, text=True)
    print(f"$ {' '.join(map(str, args))[-160:]}  rc={r.returncode} {time.time() - t:.1f}s", flush=True)
    for ln in r.stderr.splitlines():
        if "lbannpy.train:" in ln or "Error" in ln or "error" in ln:
            print("   ", ln[-400:])
    if ok and r.returncode:
        print(r.stdout[-3000:], r.stderr[-6000:])
        sys.exit(1)
    return r


def build(tag, steps, dtype="float64", spatial=8, batch=4, data="blobs.h5", layers=BN_NET, log=2):
    cfg = {"model": {"name": "g", "input": {"channels": 3, "spatial": [spatial, spatial]}, "layers": layers,
                     "loss": "cross_entropy"},
           "data": {"train": {"path": f"{W}/{data}"}, "validation": {"fraction": 0.25}},
           "trainer": {"batch_size": batch, "steps": steps, "seed": 5, "dtype": dtype, "eval_every": 3},
           "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
           "checkpoint": {"dir": f"{W}/{tag}/ckpt"}, "output": {"dir": f"{W}/{tag}/out", "log_every": log}}
    with open(f"{W}/{tag}.yaml", "w") as f:
        yaml.safe_dump(cfg, f)
    sh("-m", "lbannpy.config", "build", f"{W}/{tag}.yaml", "-o", f"{W}/{tag}.h5")
    return f"{W}/{tag}.h5"


GPU = ["--quiet", "--set", "runtime.device=gpu", "--set", "runtime.backend=single", "--set",
       "runtime.kernels=own"]


def train(h5, mode, *extra, ok=True):
    return sh("-m", "lbannpy.train", h5, *GPU, "--set", f"runtime.cuda_graph={mode}", *extra, ok=ok)


def tensors(tag):
    from lbannpy import checkpoint
    return checkpoint.load_newest(f"{W}/{tag}/ckpt")[1]["tensors"]


def rows(tag):
    import csv
    with open(f"{W}/{tag}/out/metrics.csv") as f:
        return list(csv.DictReader(f))


def compare(tag, ref):
    a, b = tensors(tag), tensors(ref)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    same = a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    lb = [(r["step"], r["loss"], r["grad_norm"]) for r in rows(ref)]
    # a run stopped early logs its last step too: the reference's steps are compared
    la = [(r["step"], r["loss"], r["grad_norm"]) for r in rows(tag) if r["step"] in {s for s, _, _ in lb}]
    sa = json.load(open(f"{W}/{tag}/out/summary.json"))
    sb = json.load(open(f"{W}/{ref}/out/summary.json"))
    print(f"== {tag} vs {ref}: tensors {'EQUAL' if same else 'DIFFER'} (max abs {worst:.3g}, "
          f"{len(a)} tensors); losses {'EQUAL' if la == lb else 'DIFFER'}; validation "
          f"{'EQUAL' if sa['validation'] == sb['validation'] else 'DIFFER'}; "
          f"cuda_graph {sa.get('cuda_graph')}", flush=True)
    if la != lb:
        print("   ", la, "\n   ", lb)
    return same and la == lb and sa["validation"] == sb["validation"]


sh("-m", "lbannpy.data", "blobs", "--size", "8", "--samples", "16", "--classes", "4", "-o", f"{W}/blobs.h5")
what = sys.argv[2] if len(sys.argv) > 2 else "all"
if what in ("all", "equal"):
    train(build("eager", 8), "off")
    train(build("graph", 8), "on")
    ok1 = compare("graph", "eager")
    train(build("resumed", 5), "on")
    train(build("resumed", 8), "on", "--resume")
    ok2 = compare("resumed", "eager")
    print("EQUALITY", "PASS" if ok1 and ok2 else "FAIL", flush=True)
    if not (ok1 and ok2):
        sys.exit(1)
if what in ("all", "speed"):
    sh("-m", "lbannpy.data", "blobs", "--size", "32", "--samples", "512", "--classes", "4", "-o",
       f"{W}/b32.h5")
    lenet = [{"name": "c1", "type": "conv", "filters": 6, "kernel": 5}, {"name": "b1", "type": "batchnorm"},
             {"name": "r1", "type": "relu"}, {"name": "p1", "type": "pool", "kernel": 2},
             {"name": "c2", "type": "conv", "filters": 16, "kernel": 5}, {"name": "r2", "type": "relu"},
             {"name": "p2", "type": "pool", "kernel": 2}, {"name": "f1", "type": "fc", "units": 120},
             {"name": "r3", "type": "relu"}, {"name": "f2", "type": "fc", "units": 84},
             {"name": "r4", "type": "relu"}, {"name": "f3", "type": "fc", "units": 4}]
    for mode in ("off", "on"):
        tag = f"speed-{mode}"
        train(build(tag, 200, "float32", 32, 32, "b32.h5", lenet, log=10), mode)
        s = json.load(open(f"{W}/{tag}/out/summary.json"))
        print(f"SPEED lenet-like 32x32 b32 float32 cuda_graph={mode}: median logged step "
              f"{s['median_step_s'] * 1e3:.3f} ms ({s.get('cuda_graph')})", flush=True)
