"""Synthetic 3-D mesh-tangling data: a hexahedral Lagrangian mesh deformed by a random smooth velocity field.

The volume counterpart of :mod:`lbannpy.data.mesh` (``python -m lbannpy.data mesh3d``), for models that
segment volumes (the zoo's ``unet3d``):

* the mesh is ``D × N × N`` hexahedral cells (depth, height, width), ``(D+1) × (N+1) × (N+1)`` nodes,
  initially uniform on the box ``[0, D/N] × [0, 1] × [0, 1]`` (cells are cubes);
* the nodes move with a velocity field that superposes smooth modes: localised vortices about random axes
  (``u = rate · g(r) · a × (x - c)`` with a Gaussian ``g``: divergence free, solid rotation inside, strain
  around), a shear layer across a tilted plane, and compressive potential modes (``u = ∇φ``);
* the nodes are advanced by explicit Euler steps (``--steps``, default 4); a step maps a cell by
  ``I + dt ∇u``, whose determinant turns negative where strain or compression is strong against the step, so
  cells shrink, shear and finally invert, as in a code that takes too large a step;
* state variables follow the cells (mass conservation, adiabatic compression of an ideal gas, two materials
  across a wavy interface), metrics are computed from the final node positions, rates from the last step.

Channels (attribute ``channel_names`` of the ``inputs`` dataset and of the file, in this order):

==  =====================  ===================================================================================
 0  density                cell mass / cell volume (volume clamped below at 1 % of the initial volume)
 1  pressure               ideal gas, gamma = 1.4: (gamma - 1) * density * internal_energy
 2  internal_energy        initial field times (density / initial density) ** (gamma - 1) (adiabatic)
 3  velocity_x             mean of the eight node velocities (domain lengths per unit time)
 4  velocity_y
 5  velocity_z
 6  volume                 mean of the eight corner Jacobians / initial volume (a parallelepiped's volume)
 7  jacobian_min           smallest corner Jacobian / initial one (negative: the cell is tangled)
 8  aspect_ratio           longest / shortest of the three mean edge vectors (1 for a cube)
 9  displacement           distance of the centroid from its initial position, in initial cell widths
10  divergence             trace of the cell's velocity gradient (from the mean edge vectors)
11  vorticity              magnitude of the curl of the velocity (same gradient)
12  jacobian_trend         jacobian_min after the last step minus jacobian_min before it
13  artificial_viscosity   von Neumann-Richtmyer q (quadratic + linear terms; 0 where the cell expands)
==  =====================  ===================================================================================

Label (``labels``, uint8, one per cell at the input's resolution): 1 where the cell is tangled
(``jacobian_min < 0``) or about to tangle (``jacobian_min < threshold`` and ``jacobian_trend < 0``), as in
the 2-D generator. Datasets: ``inputs`` float32 ``(M, C, D, N, N)``, ``labels`` uint8 ``(M, D, N, N)``, one
sample per chunk. Sample ``i`` is drawn from ``SeedSequence(seed, spawn_key=(i,))``, so equal parameters
give byte-identical files and a sample does not depend on how many are made; the field lives on the unit
cube, so sizes show the same structures at different resolution.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import numpy as np

from .mesh import AREA_FLOOR, GAMMA, Q_LIN, Q_QUAD, MeshDataError, sample_rng

FORMAT = "lbannpy-mesh3d"
VERSION = 1

CHANNEL_NAMES = (
    "density", "pressure", "internal_energy", "velocity_x", "velocity_y", "velocity_z", "volume",
    "jacobian_min", "aspect_ratio", "displacement", "divergence", "vorticity", "jacobian_trend",
    "artificial_viscosity",
)
NUM_CHANNELS = len(CHANNEL_NAMES)
CH = {name: i for i, name in enumerate(CHANNEL_NAMES)}
MAX_CHUNK_BYTES = 2**32 - 1   # HDF5 limit on one chunk


@dataclass(frozen=True)
class Mesh3DParams:
    """Generator parameters; stored as JSON in the file attribute ``params``. ``depth`` 0 means ``size``.

    Amplitudes are in units of the unit cube per unit time; the run lasts one unit of time split into
    ``steps`` Euler steps."""

    size: int = 32
    samples: int = 4
    depth: int = 0
    seed: int = 0
    channels: int = NUM_CHANNELS
    steps: int = 4
    vortices: tuple[int, int] = (4, 9)          # count drawn from [lo, hi)
    vortex_rate: float = 6.0         # peak rotation rate scale of a vortex, 1 / time
    vortex_core: tuple[float, float] = (0.08, 0.2)   # Gaussian core radius, domain lengths
    shear: float = 0.8               # shear-layer velocity jump scale
    compression: float = 0.012       # potential-mode amplitude scale
    modes: int = 6                   # number of potential modes
    threshold: float = 0.25          # "about to tangle": jacobian_min below this and decreasing

    def __post_init__(self):
        if self.size < 2:
            raise MeshDataError(f"--size must be at least 2 cells, got {self.size}")
        if self.depth < 0 or self.depth == 1:
            raise MeshDataError(f"--depth must be at least 2 cells (or 0: --size), got {self.depth}")
        if self.samples < 1:
            raise MeshDataError(f"--samples must be at least 1, got {self.samples}")
        if not 1 <= self.channels <= NUM_CHANNELS:
            raise MeshDataError(f"--channels must be between 1 and {NUM_CHANNELS} (the first C of "
                                f"{', '.join(CHANNEL_NAMES)}), got {self.channels}")
        if self.steps < 2:
            raise MeshDataError(f"--steps must be at least 2 (the Jacobian trend needs two), got "
                                f"{self.steps}")
        if self.seed < 0:
            raise MeshDataError(f"--seed must be non-negative, got {self.seed}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """Cells ``(D, N, N)``."""
        return (self.depth or self.size, self.size, self.size)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True)
class Field3D:
    """One sample's velocity field."""

    centre: np.ndarray   # (nv, 3) vortex centres (x, y, z)
    axis: np.ndarray     # (nv, 3) unit rotation axes
    rate: np.ndarray     # (nv,) peak rotation rate, signed
    core: np.ndarray     # (nv,) Gaussian core radius
    vphase: np.ndarray   # (nv,) phase of the rate's modulation in time
    shear: float         # velocity jump across the shear layer
    normal: np.ndarray   # (3,) unit normal of the layer's plane
    along: np.ndarray    # (3,) unit flow direction, in the plane
    offset: float        # the plane's distance from the box centre
    width: float         # its half width
    k: np.ndarray        # (modes, 3) potential-mode wave numbers
    amp: np.ndarray      # (modes,) potential amplitudes
    phase: np.ndarray    # (modes,)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def draw_field(rng: np.random.Generator, p: Mesh3DParams) -> Field3D:
    nv = int(rng.integers(p.vortices[0], p.vortices[1]))
    depth = p.shape[0] / p.size
    centre = rng.uniform(0.1, 0.9, (nv, 3)) * np.array([1.0, 1.0, depth])
    strength = rng.uniform(0.3, 1.0, nv) * rng.choice([-1.0, 1.0], nv)
    normal = _unit(rng.standard_normal(3))
    along = _unit(np.cross(normal, rng.standard_normal(3)))
    k = rng.integers(1, 4, size=(p.modes, 3)).astype(np.float64) * rng.choice([-1.0, 1.0], (p.modes, 3))
    return Field3D(
        centre=centre, axis=_unit(rng.standard_normal((nv, 3))), rate=p.vortex_rate * strength,
        core=rng.uniform(*p.vortex_core, nv), vphase=rng.uniform(0.0, 2 * math.pi, nv),
        shear=float(p.shear * rng.uniform(-1.0, 1.0)), normal=normal, along=along,
        offset=float(rng.uniform(-0.2, 0.2)), width=float(rng.uniform(0.03, 0.1)),
        k=k, amp=p.compression * rng.uniform(-1.0, 1.0, p.modes) / (k * k).sum(axis=1),
        phase=rng.uniform(0.0, 2 * math.pi, p.modes))


def velocity(f: Field3D, pos: list[np.ndarray], t: float, centre: np.ndarray) -> list[np.ndarray]:
    """Velocity ``[ux, uy, uz]`` at points ``pos = [x, y, z]`` and time ``t`` in [0, 1]; ``centre`` is the
    box centre (the shear plane passes near it)."""
    u = [np.zeros_like(pos[0]) for _ in range(3)]
    for i in range(len(f.rate)):
        d = [pos[a] - f.centre[i, a] for a in range(3)]
        rate = f.rate[i] * (1.0 + 0.3 * math.sin(2 * math.pi * t + f.vphase[i]))
        g = np.exp((d[0] * d[0] + d[1] * d[1] + d[2] * d[2]) * (-0.5 / f.core[i] ** 2))
        g *= rate
        a = f.axis[i]
        u[0] += (a[1] * d[2] - a[2] * d[1]) * g   # a × d: rotation about the axis through the centre
        u[1] += (a[2] * d[0] - a[0] * d[2]) * g
        u[2] += (a[0] * d[1] - a[1] * d[0]) * g
    dist = sum((pos[a] - centre[a]) * f.normal[a] for a in range(3)) - f.offset
    s = np.tanh(dist / f.width)
    s *= f.shear
    for a in range(3):
        u[a] += s * f.along[a]
    w = 2 * math.pi
    for i in range(len(f.amp)):
        arg = sum((f.k[i, a] * w) * pos[a] for a in range(3)) + f.phase[i]
        sn = np.sin(arg)
        sn *= -f.amp[i] * w
        for a in range(3):
            u[a] += f.k[i, a] * sn
    return u


def _corner(arr: np.ndarray, dz: int, dy: int, dx: int) -> np.ndarray:
    """The (D, N, N) view of node array ``arr`` at cell corner ``(dz, dy, dx)``."""
    d, n, m = (s - 1 for s in arr.shape)
    return arr[dz:dz + d, dy:dy + n, dx:dx + m]


def _dot(a, b):
    return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]


def _cross(a, b):
    return [a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]]


CORNERS = [(dz, dy, dx) for dz in (0, 1) for dy in (0, 1) for dx in (0, 1)]


def corner_jacobians(pos: list[np.ndarray]) -> list[np.ndarray]:
    """Signed corner Jacobians of every cell (8 arrays): the triple product of the three edges leaving the
    corner, each oriented along +x, +y, +z of the undeformed cell (positive while the cell is not
    inverted)."""
    out = []
    for dz, dy, dx in CORNERS:
        p = [_corner(c, dz, dy, dx) for c in pos]
        ex = [(_corner(c, dz, dy, 1 - dx) - p[a]) * (1 - 2 * dx) for a, c in enumerate(pos)]
        ey = [(_corner(c, dz, 1 - dy, dx) - p[a]) * (1 - 2 * dy) for a, c in enumerate(pos)]
        ez = [(_corner(c, 1 - dz, dy, dx) - p[a]) * (1 - 2 * dz) for a, c in enumerate(pos)]
        out.append(_dot(ex, _cross(ey, ez)))
    return out


def _mean_edges(arrs: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Per cell, the mean over the four parallel edges along x, y and z of each node array's difference."""
    out = []
    for axis in range(3):
        edges = []
        for a in arrs:
            s = 0.0
            for dz, dy, dx in CORNERS:
                if (dx, dy, dz)[axis] == 0:
                    hi = (dz + (axis == 2), dy + (axis == 1), dx + (axis == 0))
                    s = s + (_corner(a, *hi) - _corner(a, dz, dy, dx))
            edges.append(0.25 * s)
        out.append(edges)
    return out


def _mean_nodes(a: np.ndarray) -> np.ndarray:
    return sum(_corner(a, *c) for c in CORNERS) / 8.0


def cell_features(pos, vel, pos0, rho0, e0, jmin_prev, h: float) -> np.ndarray:
    """All channels of every cell, float32 ``(C, D, N, N)``, from node positions and velocities."""
    v0 = h ** 3
    jac = corner_jacobians(pos)
    jmin = np.minimum.reduce(jac)
    vol = sum(jac) / 8.0
    out = np.empty((NUM_CHANNELS,) + jmin.shape, dtype=np.float32)
    rho = rho0 * v0 / np.maximum(vol, AREA_FLOOR * v0)
    e = e0 * (rho / rho0) ** (GAMMA - 1.0)
    p = (GAMMA - 1.0) * rho * e
    out[CH["density"]], out[CH["pressure"]], out[CH["internal_energy"]] = rho, p, e
    for a, name in enumerate(("velocity_x", "velocity_y", "velocity_z")):
        out[CH[name]] = _mean_nodes(vel[a])
    out[CH["volume"]] = vol / v0
    out[CH["jacobian_min"]] = jmin / v0
    ex, ey, ez = _mean_edges(pos)
    lens = [np.sqrt(_dot(e_, e_)) for e_ in (ex, ey, ez)]
    out[CH["aspect_ratio"]] = np.maximum.reduce(lens) / np.maximum(np.minimum.reduce(lens), 1e-12)
    out[CH["displacement"]] = np.sqrt(sum((_mean_nodes(pos[a]) - _mean_nodes(pos0[a])) ** 2
                                          for a in range(3))) / h
    # velocity gradient G = dU M^-1, M's columns the mean edges: M^-1's rows are (ey×ez, ez×ex, ex×ey)/det
    det = _dot(ex, _cross(ey, ez))
    det = np.where(np.abs(det) < 1e-3 * v0, np.copysign(1e-3 * v0, det), det)
    rows = [_cross(ey, ez), _cross(ez, ex), _cross(ex, ey)]
    du = _mean_edges(vel)   # du[k][i]: change of velocity component i along edge direction k
    grad = [[sum(du[k][i] * rows[k][j] for k in range(3)) / det for j in range(3)] for i in range(3)]
    div = grad[0][0] + grad[1][1] + grad[2][2]
    out[CH["divergence"]] = div
    out[CH["vorticity"]] = np.sqrt((grad[2][1] - grad[1][2]) ** 2 + (grad[0][2] - grad[2][0]) ** 2
                                   + (grad[1][0] - grad[0][1]) ** 2)
    out[CH["jacobian_trend"]] = (jmin - jmin_prev) / v0
    comp = np.minimum(div, 0.0)
    ell = np.cbrt(np.abs(vol))
    cs = np.sqrt(GAMMA * np.maximum(p, 0.0) / rho)
    out[CH["artificial_viscosity"]] = rho * (Q_QUAD * (ell * comp) ** 2 - Q_LIN * cs * ell * comp)
    return out


def make_labels(features: np.ndarray, threshold: float) -> np.ndarray:
    """1 where the cell is tangled or about to tangle (see the module docstring), as uint8."""
    j = features[CH["jacobian_min"]]
    trend = features[CH["jacobian_trend"]]
    return ((j < 0) | ((j < threshold) & (trend < 0))).astype(np.uint8)


def generate_sample(p: Mesh3DParams, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``index``: inputs ``(channels, D, N, N)`` float32 and labels ``(D, N, N)`` uint8."""
    rng = sample_rng(p.seed, index)
    f = draw_field(rng, p)
    d, n, _ = p.shape
    h = 1.0 / n
    z, y, x = np.meshgrid(np.arange(d + 1) * h, np.arange(n + 1) * h, np.arange(n + 1) * h, indexing="ij")
    pos0 = [x, y, z]
    centre = np.array([0.5, 0.5, 0.5 * d * h])
    # two materials across a wavy interface in z, and a smooth variation of the internal energy
    kx, ky = rng.integers(1, 4, 2)
    cx, cy, cz = (_mean_nodes(c) for c in pos0)
    wave = centre[2] + 0.1 * np.sin(2 * math.pi * (kx * cx + ky * cy + rng.uniform()))
    heavy = 1.0 / (1.0 + np.exp(-(cz - wave) / (2 * h + 0.01)))
    rho0 = 1.0 + rng.uniform(0.5, 2.0) * heavy
    fx, fy, fz = rng.uniform(0.5, 2.0, 3)
    e0 = 2.5 * (1.0 + 0.2 * np.cos(2 * math.pi * (cx * fx + cy * fy + cz * fz)))
    del wave, heavy, cx, cy, cz
    pos = [c.copy() for c in pos0]
    dt = 1.0 / p.steps
    jmin_prev = vel = None
    for step in range(p.steps):
        vel = velocity(f, pos, step * dt, centre)
        if step == p.steps - 1:
            jmin_prev = np.minimum.reduce(corner_jacobians(pos))
        for a in range(3):
            pos[a] += dt * vel[a]
    feats = cell_features(pos, vel, pos0, rho0, e0, jmin_prev, h)
    labels = make_labels(feats, p.threshold)
    if p.channels < NUM_CHANNELS:
        feats = np.ascontiguousarray(feats[:p.channels])
    return feats, labels


def write_mesh3d(path: str, p: Mesh3DParams, progress=None) -> dict:
    """Generate ``p.samples`` volumes into the HDF5 file ``path`` (datasets and attributes as the 2-D
    generator's, with a depth dimension); returns a summary dict."""
    import h5py

    (d, n, _), m, c = p.shape, p.samples, p.channels
    chunk = (1, c, d, n, n) if c * d * n * n * 4 <= MAX_CHUNK_BYTES else (1, 1, d, n, n)
    names = np.array(CHANNEL_NAMES[:c], dtype=h5py.string_dtype())
    per_sample = np.empty(m, dtype=np.float64)
    with h5py.File(path, "w", track_order=False) as fh:
        fh.attrs["format"] = FORMAT
        fh.attrs["version"] = VERSION
        fh.attrs["generator"] = "mesh3d"
        fh.attrs["params"] = p.to_json()
        fh.attrs["channel_names"] = names
        fh.attrs["label_names"] = np.array(["ok", "needs_relaxation"], dtype=h5py.string_dtype())
        dx = fh.create_dataset("inputs", shape=(m, c, d, n, n), dtype=np.float32, chunks=chunk,
                               track_times=False)
        dy = fh.create_dataset("labels", shape=(m, d, n, n), dtype=np.uint8, chunks=(1, d, n, n),
                               track_times=False)
        dx.attrs["channel_names"] = names
        for i in range(m):
            feats, labels = generate_sample(p, i)
            dx.write_direct(feats, dest_sel=np.s_[i])
            dy.write_direct(labels, dest_sel=np.s_[i])
            per_sample[i] = np.count_nonzero(labels) / labels.size
            if progress is not None:
                progress(i, per_sample[i])
        frac = float(per_sample.mean())
        fh.attrs["positive_fraction"] = frac
        dy.attrs["positive_fraction"] = frac
        fh.create_dataset("positive_fraction_per_sample", data=per_sample, track_times=False)
    return {"path": path, "samples": m, "shape": (d, n, n), "channels": c, "positive_fraction": frac,
            "positive_fraction_min": float(per_sample.min()),
            "positive_fraction_max": float(per_sample.max())}
