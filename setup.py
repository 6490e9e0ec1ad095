"""Build hook for the optional compiled kernels (metadata lives in setup.cfg).

``optional=True``: where no C compiler is available the build goes on without the extensions;
``lbannpy.layers.kernels.conv`` and ``lbannpy.layers.kernels.batchnorm`` then use their NumPy paths."""
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """Says what the silent minute of the install is (pip shows it with -v; its spinner otherwise)."""

    def build_extensions(self):
        sys.stderr.write(f"lbannpy: compiling {len(self.extensions)} optional C kernels (a minute or more; "
                         f"without a C compiler the NumPy kernels are used)\n")
        sys.stderr.flush()
        super().build_extensions()


setup(cmdclass={"build_ext": BuildExt}, ext_modules=[
    Extension("lbannpy.layers.kernels._cconv", ["layers/kernels/_cconv.c"],
              depends=["layers/kernels/_cconv_impl.h"],
              extra_compile_args=["-O3", "-ffp-contract=fast", "-Wno-psabi"], optional=True),
    Extension("lbannpy.layers.kernels._csmall", ["layers/kernels/_csmall.c"],
              extra_compile_args=["-O3"], optional=True),
    Extension("lbannpy.layers.kernels._conv1c", ["layers/kernels/_conv1c.c"],
              extra_compile_args=["-O3", "-ffp-contract=fast", "-Wno-psabi"], optional=True),
    # no contraction: the affine steps round as NumPy's separate multiply and add do
    Extension("lbannpy.layers.kernels._cbn", ["layers/kernels/_cbn.c"],
              extra_compile_args=["-O3", "-ffp-contract=off"], optional=True),
    # no contraction (rounds as NumPy step by step); no trapping math: the inline exp's clamps vectorise
    Extension("lbannpy.layers.kernels._cact", ["layers/kernels/_cact.c"],
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-trapping-math"], optional=True),
    Extension("lbannpy.layers.kernels._cnorm", ["layers/kernels/_cnorm.c"],
              extra_compile_args=["-O3", "-ffp-contract=fast", "-Wno-psabi"], optional=True),
    Extension("lbannpy._crelayout", ["src/_crelayout.c"], extra_compile_args=["-O3"], optional=True),
    Extension("lbannpy.layers.kernels._cupsample", ["layers/kernels/_cupsample.c"],
              extra_compile_args=["-O3", "-ffp-contract=off", "-Wno-psabi"], optional=True),
])
