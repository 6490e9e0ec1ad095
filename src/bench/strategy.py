"""Strategy-selector benchmarks: ``python -m lbannpy.bench strategy`` or ``python -m lbannpy.bench.strategy``.

Sections (``--only`` picks some): ``time`` (planning and search time, Inception-v3 and ResNet-50 at 4, 16,
64 ranks), ``vgg`` (the VGG-16 strategy on 4 P100s next to Jia et al. Table 5, and Table 5's configurations
priced by our model term by term), ``speedup`` (predicted speedups over data parallelism next to the ranges
Jia et al. report), ``mesh`` (mesh2k under a 16 GiB limit). Everything printed is computed by the model; the
paper's numbers are quoted for comparison only.
"""
from __future__ import annotations


import argparse
import sys
import time

from lbannpy import zoo
from lbannpy.dist import Distribution
from lbannpy.strategy.planner import GIB, evaluate_strategy, plan
from lbannpy.strategy.report import compare, explain

SECTIONS = ("time", "vgg", "speedup", "mesh")

# Jia et al. (2018), Table 5 and §6.3, quoted.
JIA_TABLE5 = [
    ("2 x Conv + Pooling", ["conv1_1", "conv1_2", "pool1"], "{n=4, h=1, w=1, c=1}"),
    ("2 x Conv + Pooling", ["conv2_1", "conv2_2", "pool2"], "{n=4, h=1, w=1, c=1}"),
    ("3 x Conv + Pooling", ["conv3_1", "conv3_2", "conv3_3", "pool3"], "{n=4, h=1, w=1, c=1}"),
    ("3 x Conv + Pooling", ["conv4_1", "conv4_2", "conv4_3", "pool4"], "{n=4, h=1, w=1, c=1}"),
    ("3 x Conv + Pooling", ["conv5_1", "conv5_2", "conv5_3", "pool5"], "{n=1, h=2, w=2, c=1}"),
    ("Fully-connected", ["fc6"], "{n=1, c=4}"),
    ("Fully-connected", ["fc7"], "(row left blank in the extracted table)"),
    ("Fully-connected", ["fc8"], "{n=1, c=2}"),
    ("Softmax", [], "{n=1, c=1}"),
]
JIA_TABLE5_TEXT = ("\"This strategy first uses parallelism in the sample dimension for the beginning "
                   "convolutional and pooling layers and then uses parallelism in both the height and width "
                   "dimensions to accelerate the last three convolutional layers. For the fully-connected "
                   "layers, it uses parallelism in the channel dimension to reduce communication costs and "
                   "adaptively decreases the degrees of parallelism.\" (Jia et al. 2018, §6.3)")
JIA_SPEEDUP_TEXT = ("\"layer-wise parallelism consistently outperforms the other strategies and increases "
                    "the training throughput by up to 2.2x, 1.5x, and 1.4x for AlexNet, VGG-16, and "
                    "Inception-v3, respectively.\" and \"Scaling ... from 1 GPU to 16 GPUs (on 4 nodes), "
                    "layer-wise parallelism achieves 12.2x, 14.8x, and 15.5x speedup for AlexNet, VGG-16, "
                    "and Inception-v3, respectively, while the best other strategy achieves 6.1x, 10.2x, "
                    "and 11.2x speedup.\" (Jia et al. 2018, §6.1)")
JIA_REPORTED = {"alexnet": (2.2, 12.2, 6.1), "vgg16": (1.5, 14.8, 10.2), "inception_v3": (1.4, 15.5, 11.2)}


def section_time(machine: str) -> None:
    print("== planning time (batch 32 per rank) ==")
    print(f"{'model':14s} {'ranks':>5s} {'layers':>6s} {'cands':>6s} {'K':>3s} {'tables s':>9s} "
          f"{'search s':>9s} {'total s':>8s} {'heuristic s':>11s}")
    for name in ("inception_v3", "resnet50"):
        for ranks in (4, 16, 64):
            spec = zoo.get_spec(name, batch_size=32 * ranks)
            t0 = time.perf_counter()
            p = plan(spec, ranks, machine, compare=False, heuristic=True)
            total = time.perf_counter() - t0
            print(f"{name:14s} {ranks:5d} {len(p.graph):6d} {sum(len(v) for v in p.candidates.values()):6d} "
                  f"{p.result.final_nodes:3d} {p.table_seconds:9.3f} {p.search_seconds:9.3f} {total:8.3f} "
                  f"{p.heuristic.seconds:11.3f}")
    print("(target: search < 1 s; 'tables' = candidate enumeration and cost tables, 'K' = layers left after "
          "node/edge elimination; Jia et al. Table 3 reports K = 2 and 0.4 s for Inception-v3 on 4 GPUs)")


def section_vgg(machine: str) -> None:
    print("== VGG-16 on 4 devices, batch 32 per device ==")
    p = plan(zoo.get_spec("vgg16", batch_size=128), 4, machine)
    print(f"{'Jia Table 5 layers':22s} {'Jia configuration':40s} ours (per layer)")
    for label, layers, cfg in JIA_TABLE5:
        ours = ", ".join(f"{n}={p.choice[n]}" for n in layers) if layers else "(loss: not a layer here)"
        print(f"{label:22s} {cfg:40s} {ours}")
    rest = [n.name for n in p.graph if n.type not in ("conv", "pool", "fc")]
    print("pointwise layers: " + ", ".join(f"{n}={p.choice[n]}" for n in rest))
    print(JIA_TABLE5_TEXT)
    print(compare(p))
    # Jia's configurations where they differ from ours, priced by our model, term by term
    jia = dict(p.choice)
    for n in p.graph:
        if n.name[4:5] == "5":  # conv5_x, relu5_x, pool5
            jia[n.name] = Distribution.make(4, 4, h=2, w=2)
    jia["fc8"] = Distribution.make(2, 4, c=2)
    theirs = evaluate_strategy(p.graph, jia, p.machine)
    print(f"Jia Table 5 (conv5_x, pool5 h2·w2; fc8 c2; the rest as chosen) under this model: "
          f"{theirs.step_s * 1e3:.3f} ms vs chosen {p.chosen.step_s * 1e3:.3f} ms")
    for name in [n.name for n in p.graph if jia[n.name] != p.choice[n.name]]:
        a, b = theirs.layer[name], p.chosen.layer[name]
        print(f"  {name:8s} {str(jia[name]):6s} vs {str(p.choice[name]):4s}: "
              f"compute {a.compute_s * 1e3:7.3f} / "
              f"{b.compute_s * 1e3:7.3f} ms, halo+in-layer {(a.halo_s + a.internal_comm_s) * 1e3:6.3f} / "
              f"{(b.halo_s + b.internal_comm_s) * 1e3:6.3f}, t_S {a.t_s * 1e3:6.3f} / {b.t_s * 1e3:6.3f}, "
              f"t_X in {theirs.transfer_in[name] * 1e3:6.3f} / {p.chosen.transfer_in[name] * 1e3:6.3f}")
    print(f"  fc6 (unchanged) t_X in {theirs.transfer_in['fc6'] * 1e3:.3f} / "
          f"{p.chosen.transfer_in['fc6'] * 1e3:.3f} ms: the edge out of pool5 is priced at its consumer")


def section_speedup(machine: str) -> None:
    print("== predicted speedup over data parallelism, batch 32 per device ==")
    print(JIA_SPEEDUP_TEXT)
    print(f"{'model':14s} {'devices':>7s} {'data ms':>9s} {'owt ms':>9s} {'model ms':>9s} {'chosen ms':>9s} "
          f"{'vs data':>8s} {'vs best other':>13s} {'1->P chosen':>11s} {'1->P best other':>15s}")
    for name in ("alexnet", "vgg16", "inception_v3"):
        one = plan(zoo.get_spec(name, batch_size=32), 1, machine, compare=False).chosen.step_s
        for ranks in (4, 8, 16):
            p = plan(zoo.get_spec(name, batch_size=32 * ranks), ranks, machine)
            b = p.baselines
            best_other = min(s.step_s for s in b.values())
            c = p.chosen.step_s
            print(f"{name:14s} {ranks:7d} {b['data-parallel'].step_s * 1e3:9.2f} "
                  f"{b['owt'].step_s * 1e3:9.2f} "
                  f"{b['model-parallel'].step_s * 1e3:9.2f} {c * 1e3:9.2f} "
                  f"{b['data-parallel'].step_s / c:7.2f}x {best_other / c:12.2f}x "
                  f"{ranks * one / c:10.1f}x {ranks * one / best_other:14.1f}x")
        up, lw, other = JIA_REPORTED[name]
        print(f"{'':14s} Jia et al.: up to {up}x over the other strategies; 1->16 GPUs {lw}x layer-wise vs "
              f"{other}x best other")


def section_mesh(machine: str) -> None:
    print("== mesh2k (2048x2048, 18 channels), 16 GiB per device ==")
    for batch, ranks in ((8, 16), (16, 16)):
        spec = zoo.get_spec("mesh2k", batch_size=batch)
        print(f"-- batch {batch} on {ranks} ranks ({ranks / batch:g} ranks per sample), machine {machine}")
        try:
            p = plan(spec, ranks, machine, memory_gib=16)
        except ValueError as exc:
            print(f"no plan: {exc}")
            continue
        print(compare(p))
        lines = [ln for ln in explain(p).splitlines() if "does not fit" in ln or ln.startswith("note")]
        print("\n".join(lines))
        kinds = {}
        for n, d in p.choice.items():
            kinds.setdefault(str(d), []).append(n)
        for d, names in kinds.items():
            print(f"chosen {d:14s} for {len(names):3d} layers: {names[0]} .. {names[-1]}")
        spatial = sum(1 for d in p.choice.values() if any(s > 1 for s in d.split[2:]))
        print(f"{spatial} of {len(p.choice)} layers split spatially; predicted memory "
              f"{p.chosen.memory_bytes / GIB:.2f} GiB per rank")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench strategy", description=(
        "Strategy-selector benchmarks: search time, the VGG-16 strategy next to Jia et al., predicted "
        "speedups "
        "over data parallelism, the mesh models."))
    ap.add_argument("--machine", default="p100", help="machine for time/vgg/speedup (default p100)")
    ap.add_argument("--mesh-machine", default="lassen", help="machine for the mesh section (default lassen)")
    ap.add_argument("--only", nargs="*", choices=SECTIONS, default=list(SECTIONS),
                    help="sections to run (default all)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for s in args.only:
        {"time": lambda: section_time(args.machine), "vgg": lambda: section_vgg(args.machine),
         "speedup": lambda: section_speedup(args.machine),
         "mesh": lambda: section_mesh(args.mesh_machine)}[s]()
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
