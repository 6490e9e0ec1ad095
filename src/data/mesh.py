"""Synthetic mesh-tangling data: a 2-D Lagrangian mesh deformed by a random smooth velocity field.

The data set of Dryden et al. (2019) holds snapshots of a hydrodynamics code: 18 channels of state
variables and mesh-quality metrics per cell, and a per-cell label saying whether the cell must be relaxed
to keep the mesh from tangling. This module produces data that behaves like it, from a seed:

* the mesh is ``N × N`` quadrilateral cells, ``(N+1) × (N+1)`` nodes, initially uniform on the unit square;
* the nodes move with a velocity field that is a random superposition of smooth modes: Gaussian vortices
  (divergence free; rotation inside, strain around them), a shear layer, and compressive potential modes
  (divergence, so density and pressure vary);
* the nodes are advanced by explicit Euler steps of a Lagrangian code (``--steps``, default 4). An Euler
  step maps a cell's corner frame by ``I + dt ∇u``, whose determinant ``1 + dt div u + dt² det ∇u`` turns
  negative where strain or compression is strong against the step: cells shrink, shear and finally invert,
  as in a real code that takes too large a step;
* state variables follow the cells (mass conservation, adiabatic compression of an ideal gas), metrics are
  computed from the final node positions, and rates from the node velocities of the last step.

Channels (attribute ``channel_names`` of the ``inputs`` dataset and of the file, in this order):

==  =====================  ===================================================================================
 0  density                cell mass / cell area (area clamped below at 1 % of the initial area)
 1  pressure               ideal gas, gamma = 1.4: (gamma - 1) * density * internal_energy
 2  internal_energy        initial field times (density / initial density) ** (gamma - 1) (adiabatic)
 3  velocity_x             mean of the four node velocities (domain lengths per unit time)
 4  velocity_y
 5  area                   signed cell area / initial cell area
 6  jacobian_min           smallest corner Jacobian / initial one (negative: the cell is tangled)
 7  aspect_ratio           longer / shorter midline (1 for a square)
 8  skew                   |cos| of the angle between the two midlines (0 for a rectangle)
 9  angle_min              smallest signed interior angle, radians (negative at an inverted corner)
10  angle_max              largest interior angle, radians
11  edge_ratio             shortest / longest edge
12  opposite_edge_ratio    min over the two pairs of opposite edges of shorter / longer
13  displacement           distance of the centroid from its initial position, in initial cell widths
14  vorticity              d(vy)/dx - d(vx)/dy of the node velocities (Green's theorem over the cell)
15  divergence             d(vx)/dx + d(vy)/dy
16  jacobian_trend         jacobian_min after the last step minus jacobian_min before it
17  artificial_viscosity   von Neumann-Richtmyer q (quadratic + linear terms; 0 where the cell expands)
==  =====================  ===================================================================================

Label (``labels``, uint8): 1 where the cell needs relaxation, i.e. it is tangled (``jacobian_min < 0``) or
about to tangle (``jacobian_min < threshold`` and ``jacobian_trend < 0``: small and still decreasing),
0 elsewhere. The default threshold 0.25 and the field amplitudes give on the order of 10 % positives (the
generator prints the fraction; it is stored as the attribute ``positive_fraction``).

The geometry is resolution independent (the field is defined on the unit square), so a 32² file and a
1024² file from the same seed show the same structures at different resolution, and tests can use tiny
sizes. Sample ``i`` is drawn from ``SeedSequence(seed, spawn_key=(i,))``: the same seed gives byte-identical
datasets, and a sample does not depend on how many samples are generated.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import numpy as np

FORMAT = "lbannpy-mesh"
VERSION = 1

CHANNEL_NAMES = (
    "density", "pressure", "internal_energy", "velocity_x", "velocity_y", "area", "jacobian_min",
    "aspect_ratio", "skew", "angle_min", "angle_max", "edge_ratio", "opposite_edge_ratio", "displacement",
    "vorticity", "divergence", "jacobian_trend", "artificial_viscosity",
)
NUM_CHANNELS = len(CHANNEL_NAMES)
CH = {name: i for i, name in enumerate(CHANNEL_NAMES)}

GAMMA = 1.4          # ratio of specific heats of the ideal gas
Q_QUAD = 2.0         # von Neumann-Richtmyer quadratic coefficient (dimensionless)
Q_LIN = 0.2          # linear coefficient (dimensionless)
AREA_FLOOR = 0.01    # density uses max(area, AREA_FLOOR * initial area): tangled cells stay finite


class MeshDataError(ValueError):
    """Generator parameters that cannot produce a data set (the message says which and why)."""


@dataclass(frozen=True)
class MeshParams:
    """Generator parameters; stored as JSON in the file attribute ``params``.

    Amplitudes are in units of the unit square per unit time; the run lasts one unit of time split into
    ``steps`` Euler steps, so ``strain * (1 / steps) > 1`` inverts a cell in one step.
    """

    size: int = 64
    samples: int = 4
    seed: int = 0
    channels: int = NUM_CHANNELS
    steps: int = 4                   # Euler steps (the mesh is advected over a few steps)
    vortices: tuple[int, int] = (3, 7)          # count drawn from [lo, hi)
    vortex_rate: float = 5.0         # peak rotation rate scale of a vortex, 1 / time
    vortex_core: tuple[float, float] = (0.08, 0.2)   # Gaussian core radius, domain lengths
    shear: float = 0.8               # shear-layer velocity jump scale
    compression: float = 0.012       # potential-mode amplitude scale (div ~ amplitude * (2 pi k)^2)
    modes: int = 6                   # number of potential modes
    threshold: float = 0.25          # "about to tangle": jacobian_min below this and decreasing

    def __post_init__(self):
        if self.size < 2:
            raise MeshDataError(f"--size must be at least 2 cells, got {self.size}")
        if self.samples < 1:
            raise MeshDataError(f"--samples must be at least 1, got {self.samples}")
        if not 1 <= self.channels <= NUM_CHANNELS:
            raise MeshDataError(
                f"--channels must be between 1 and {NUM_CHANNELS} (the first C of "
                f"{', '.join(CHANNEL_NAMES)}), got {self.channels}")
        if self.steps < 2:
            raise MeshDataError(f"steps must be at least 2 (the Jacobian trend needs two), got {self.steps}")
        if self.seed < 0:
            raise MeshDataError(f"--seed must be non-negative, got {self.seed}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


# --------------------------------------------------------------------------------------------------------
# the random velocity field


@dataclass(frozen=True)
class Field:
    """One sample's velocity field: vortices, a shear layer and potential (compressive) modes."""

    vx0: np.ndarray      # vortex centres, x
    vy0: np.ndarray      # vortex centres, y
    vrate: np.ndarray    # peak rotation rate (signed), 1 / time
    vcore: np.ndarray    # core radius
    vphase: np.ndarray   # phase of the rate modulation in time
    shear: float         # velocity jump of the shear layer
    shear_y: float       # its position
    shear_w: float       # its half width
    shear_angle: float   # its orientation
    kx: np.ndarray       # potential-mode wave numbers (cycles per domain)
    ky: np.ndarray
    amp: np.ndarray      # potential amplitudes
    phase: np.ndarray


def draw_field(rng: np.random.Generator, p: MeshParams) -> Field:
    nv = int(rng.integers(p.vortices[0], p.vortices[1]))
    strength = rng.uniform(0.3, 1.0, nv) * rng.choice([-1.0, 1.0], nv)
    k = rng.integers(1, 4, size=(2, p.modes))
    return Field(
        vx0=rng.uniform(0.1, 0.9, nv), vy0=rng.uniform(0.1, 0.9, nv),
        vrate=p.vortex_rate * strength, vcore=rng.uniform(*p.vortex_core, nv),
        vphase=rng.uniform(0.0, 2 * math.pi, nv),
        shear=float(p.shear * rng.uniform(-1.0, 1.0)), shear_y=float(rng.uniform(0.3, 0.7)),
        shear_w=float(rng.uniform(0.03, 0.1)), shear_angle=float(rng.uniform(-0.5, 0.5)),
        kx=k[0].astype(np.float64) * rng.choice([-1.0, 1.0], p.modes), ky=k[1].astype(np.float64),
        amp=p.compression * rng.uniform(-1.0, 1.0, p.modes) / (k[0] ** 2 + k[1] ** 2),
        phase=rng.uniform(0.0, 2 * math.pi, p.modes),
    )


def velocity(f: Field, x: np.ndarray, y: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Velocity at points ``(x, y)`` and time ``t`` in [0, 1] (vectorised over the points)."""
    ux = np.zeros_like(x)
    uy = np.zeros_like(x)
    for i in range(len(f.vrate)):
        dx = x - f.vx0[i]
        dy = y - f.vy0[i]
        # stream function psi = rate * core² * exp(-r² / (2 core²)): solid rotation at the centre,
        # strain in the ring around it; the rate breathes in time so the pattern is not steady
        rate = f.vrate[i] * (1.0 + 0.3 * math.sin(2 * math.pi * t + f.vphase[i]))
        g = np.exp((dx * dx + dy * dy) * (-0.5 / f.vcore[i] ** 2))
        g *= rate
        ux -= dy * g
        uy += dx * g
    # shear layer across a tilted line: u = shear * tanh(d / w) along the line
    ca, sa = math.cos(f.shear_angle), math.sin(f.shear_angle)
    d = (y - f.shear_y) * ca - (x - 0.5) * sa
    s = np.tanh(d / f.shear_w)
    s *= f.shear
    ux += s * ca
    uy += s * sa
    # potential modes phi = amp cos(2 pi (kx x + ky y) + phase): u = grad phi
    for i in range(len(f.amp)):
        w = 2 * math.pi
        arg = (f.kx[i] * w) * x + (f.ky[i] * w) * y + f.phase[i]
        sn = np.sin(arg)
        sn *= -f.amp[i] * w
        ux += f.kx[i] * sn
        uy += f.ky[i] * sn
    return ux, uy


# --------------------------------------------------------------------------------------------------------
# mesh metrics


def _corners(x: np.ndarray, y: np.ndarray):
    """Corner coordinates of every cell, counter-clockwise from the lower left: 4 pairs of (N, N) views."""
    return ((x[:-1, :-1], y[:-1, :-1]), (x[:-1, 1:], y[:-1, 1:]),
            (x[1:, 1:], y[1:, 1:]), (x[1:, :-1], y[1:, :-1]))


def corner_jacobians(x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Signed corner Jacobians cross(next - p, prev - p) of every cell (4 arrays of shape (N, N))."""
    c = _corners(x, y)
    out = []
    for k in range(4):
        (px, py), (nx, ny), (qx, qy) = c[k], c[(k + 1) % 4], c[(k - 1) % 4]
        out.append((nx - px) * (qy - py) - (ny - py) * (qx - px))
    return out


def jacobian_min(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    j = corner_jacobians(x, y)
    return np.minimum(np.minimum(j[0], j[1]), np.minimum(j[2], j[3]))


def _grad(f, x, y, area2):
    """Cell gradient of node field ``f`` by Green's theorem over the quad (``area2`` = twice the area)."""
    f0, f1, f2, f3 = f[:-1, :-1], f[:-1, 1:], f[1:, 1:], f[1:, :-1]
    x0, x1, x2, x3 = x[:-1, :-1], x[:-1, 1:], x[1:, 1:], x[1:, :-1]
    y0, y1, y2, y3 = y[:-1, :-1], y[:-1, 1:], y[1:, 1:], y[1:, :-1]
    a, b = f2 - f0, f3 - f1
    dfdx = (a * (y3 - y1) - b * (y2 - y0)) / area2
    dfdy = (b * (x2 - x0) - a * (x3 - x1)) / area2
    return dfdx, dfdy


def cell_features(x, y, ux, uy, x_init, y_init, rho0, e0, jmin_prev, h: float) -> np.ndarray:
    """All 18 channels of every cell, float32 ``(18, N, N)``, from node positions and velocities."""
    n = x.shape[0] - 1
    out = np.empty((NUM_CHANNELS, n, n), dtype=np.float32)
    a0 = h * h
    c = _corners(x, y)
    # edges k: corner k -> corner k+1 (bottom, right, top, left)
    ex = [c[(k + 1) % 4][0] - c[k][0] for k in range(4)]
    ey = [c[(k + 1) % 4][1] - c[k][1] for k in range(4)]
    length = [np.hypot(ex[k], ey[k]) for k in range(4)]
    # corner k sits between edge k (to the next corner) and edge k-1 reversed (to the previous corner)
    jac = [ex[k] * (-ey[k - 1]) - ey[k] * (-ex[k - 1]) for k in range(4)]
    ang = [np.arctan2(jac[k], ex[k] * (-ex[k - 1]) + ey[k] * (-ey[k - 1])) for k in range(4)]
    jmin = np.minimum(np.minimum(jac[0], jac[1]), np.minimum(jac[2], jac[3]))
    # signed area from the diagonals
    area2 = (c[2][0] - c[0][0]) * (c[3][1] - c[1][1]) - (c[2][1] - c[0][1]) * (c[3][0] - c[1][0])
    area = 0.5 * area2
    safe2 = np.where(np.abs(area2) < 1e-3 * a0, np.copysign(1e-3 * a0, area2), area2)

    rho = rho0 * a0 / np.maximum(area, AREA_FLOOR * a0)
    e = e0 * (rho / rho0) ** (GAMMA - 1.0)
    p = (GAMMA - 1.0) * rho * e
    out[CH["density"]] = rho
    out[CH["pressure"]] = p
    out[CH["internal_energy"]] = e
    out[CH["velocity_x"]] = 0.25 * (ux[:-1, :-1] + ux[:-1, 1:] + ux[1:, 1:] + ux[1:, :-1])
    out[CH["velocity_y"]] = 0.25 * (uy[:-1, :-1] + uy[:-1, 1:] + uy[1:, 1:] + uy[1:, :-1])
    out[CH["area"]] = area / a0
    out[CH["jacobian_min"]] = jmin / a0
    # midlines: centre of the left edge -> centre of the right edge, bottom -> top
    mx_x = 0.5 * (c[1][0] + c[2][0] - c[0][0] - c[3][0])
    mx_y = 0.5 * (c[1][1] + c[2][1] - c[0][1] - c[3][1])
    my_x = 0.5 * (c[3][0] + c[2][0] - c[0][0] - c[1][0])
    my_y = 0.5 * (c[3][1] + c[2][1] - c[0][1] - c[1][1])
    lx = np.maximum(np.hypot(mx_x, mx_y), 1e-12)
    ly = np.maximum(np.hypot(my_x, my_y), 1e-12)
    out[CH["aspect_ratio"]] = np.maximum(lx, ly) / np.minimum(lx, ly)
    out[CH["skew"]] = np.abs(mx_x * my_x + mx_y * my_y) / (lx * ly)
    out[CH["angle_min"]] = np.minimum(np.minimum(ang[0], ang[1]), np.minimum(ang[2], ang[3]))
    out[CH["angle_max"]] = np.maximum(np.maximum(ang[0], ang[1]), np.maximum(ang[2], ang[3]))
    lmin = np.minimum(np.minimum(length[0], length[1]), np.minimum(length[2], length[3]))
    lmax = np.maximum(np.maximum(length[0], length[1]), np.maximum(length[2], length[3]))
    out[CH["edge_ratio"]] = lmin / np.maximum(lmax, 1e-12)
    r02 = np.minimum(length[0], length[2]) / np.maximum(np.maximum(length[0], length[2]), 1e-12)
    r13 = np.minimum(length[1], length[3]) / np.maximum(np.maximum(length[1], length[3]), 1e-12)
    out[CH["opposite_edge_ratio"]] = np.minimum(r02, r13)
    cx = 0.25 * (c[0][0] + c[1][0] + c[2][0] + c[3][0])
    cy = 0.25 * (c[0][1] + c[1][1] + c[2][1] + c[3][1])
    cx0 = 0.25 * (x_init[:-1, :-1] + x_init[:-1, 1:] + x_init[1:, 1:] + x_init[1:, :-1])
    cy0 = 0.25 * (y_init[:-1, :-1] + y_init[:-1, 1:] + y_init[1:, 1:] + y_init[1:, :-1])
    out[CH["displacement"]] = np.hypot(cx - cx0, cy - cy0) / h
    dvxdx, dvxdy = _grad(ux, x, y, safe2)
    dvydx, dvydy = _grad(uy, x, y, safe2)
    out[CH["vorticity"]] = dvydx - dvxdy
    div = dvxdx + dvydy
    out[CH["divergence"]] = div
    out[CH["jacobian_trend"]] = (jmin - jmin_prev) / a0
    # artificial viscosity acts only in compression; length scale sqrt(|area|), sound speed of the gas
    comp = np.minimum(div, 0.0)
    ell = np.sqrt(np.abs(area))
    cs = np.sqrt(GAMMA * np.maximum(p, 0.0) / rho)
    out[CH["artificial_viscosity"]] = rho * (Q_QUAD * (ell * comp) ** 2 - Q_LIN * cs * ell * comp)
    return out


def make_labels(features: np.ndarray, threshold: float) -> np.ndarray:
    """1 where the cell is tangled or about to tangle (see the module docstring), as uint8."""
    j = features[CH["jacobian_min"]]
    trend = features[CH["jacobian_trend"]]
    return ((j < 0) | ((j < threshold) & (trend < 0))).astype(np.uint8)


# --------------------------------------------------------------------------------------------------------
# one sample


def sample_rng(seed: int, index: int) -> np.random.Generator:
    """The generator of sample ``index``: independent of how many samples are made, or in which order."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(index,)))


def generate_sample(p: MeshParams, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``index``: inputs ``(channels, N, N)`` float32 and labels ``(N, N)`` uint8."""
    rng = sample_rng(p.seed, index)
    f = draw_field(rng, p)
    n = p.size
    h = 1.0 / n
    grid = np.arange(n + 1, dtype=np.float64) * h
    x_init, y_init = np.meshgrid(grid, grid)          # [j, i] = (y_j, x_i)
    # initial state: two materials across a wavy interface, plus smooth variations of energy
    wave = (0.5 + 0.1 * np.sin(2 * math.pi * (rng.integers(1, 4) * x_init + rng.uniform())))
    ci = 0.5 * (x_init[:-1, :-1] + x_init[1:, 1:])
    cj = 0.5 * (y_init[:-1, :-1] + y_init[1:, 1:])
    heavy = 1.0 / (1.0 + np.exp(-(cj - 0.5 * (wave[:-1, :-1] + wave[1:, 1:])) / (2 * h + 0.01)))
    rho0 = 1.0 + rng.uniform(0.5, 2.0) * heavy
    e0 = 2.5 * (1.0 + 0.2 * np.cos(2 * math.pi * (ci * rng.uniform(0.5, 2) + cj * rng.uniform(0.5, 2))))
    del wave, heavy, ci, cj

    x = x_init.copy()
    y = y_init.copy()
    dt = 1.0 / p.steps
    jmin_prev = None
    for step in range(p.steps):
        ux, uy = velocity(f, x, y, step * dt)
        if step == p.steps - 1:
            jmin_prev = jacobian_min(x, y)
        x += dt * ux
        y += dt * uy
    feats = cell_features(x, y, ux, uy, x_init, y_init, rho0, e0, jmin_prev, h)
    labels = make_labels(feats, p.threshold)
    if p.channels < NUM_CHANNELS:
        feats = np.ascontiguousarray(feats[:p.channels])
    return feats, labels


# --------------------------------------------------------------------------------------------------------
# the file


MAX_CHUNK_BYTES = 2**32 - 1   # HDF5 limit on one chunk


def write_mesh(path: str, p: MeshParams, progress=None) -> dict:
    """Generate ``p.samples`` samples into the HDF5 file ``path``; returns a summary dict.

    Datasets: ``inputs`` float32 ``(M, C, N, N)`` chunked one sample per chunk (one sample and channel
    per chunk when a sample exceeds HDF5's 4 GiB chunk limit), ``labels`` uint8 ``(M, N, N)``. Dataset
    times are not recorded, so equal parameters give byte-identical files.
    """
    import h5py

    n, m, c = p.size, p.samples, p.channels
    chunk = (1, c, n, n) if c * n * n * 4 <= MAX_CHUNK_BYTES else (1, 1, n, n)
    positives = 0
    per_sample = np.empty(m, dtype=np.float64)
    with h5py.File(path, "w", track_order=False) as fh:
        fh.attrs["format"] = FORMAT
        fh.attrs["version"] = VERSION
        fh.attrs["generator"] = "mesh"
        fh.attrs["params"] = p.to_json()
        fh.attrs["channel_names"] = np.array(CHANNEL_NAMES[:c], dtype=h5py.string_dtype())
        fh.attrs["label_names"] = np.array(["ok", "needs_relaxation"], dtype=h5py.string_dtype())
        dx = fh.create_dataset("inputs", shape=(m, c, n, n), dtype=np.float32, chunks=chunk,
                               track_times=False)
        dy = fh.create_dataset("labels", shape=(m, n, n), dtype=np.uint8, chunks=(1, n, n),
                               track_times=False)
        dx.attrs["channel_names"] = np.array(CHANNEL_NAMES[:c], dtype=h5py.string_dtype())
        for i in range(m):
            feats, labels = generate_sample(p, i)
            dx.write_direct(feats, dest_sel=np.s_[i])
            dy.write_direct(labels, dest_sel=np.s_[i])
            k = int(np.count_nonzero(labels))
            positives += k
            per_sample[i] = k / labels.size
            if progress is not None:
                progress(i, per_sample[i])
        frac = positives / (m * n * n)
        fh.attrs["positive_fraction"] = frac
        dy.attrs["positive_fraction"] = frac
        fh.create_dataset("positive_fraction_per_sample", data=per_sample, track_times=False)
    return {"path": path, "samples": m, "size": n, "channels": c, "positive_fraction": frac,
            "positive_fraction_min": float(per_sample.min()),
            "positive_fraction_max": float(per_sample.max())}
